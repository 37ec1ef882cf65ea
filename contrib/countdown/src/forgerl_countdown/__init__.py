"""The Countdown numbers game for forgerl."""
