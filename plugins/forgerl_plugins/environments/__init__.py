"""Built-in environments: ``calculator`` (arithmetic with a ``calculate`` tool) and
``guess`` (a number-guessing game with higher/lower feedback). They are registered by the
``tasks`` plugin module (forgerl_plugins.tasks, already an entry point), so an editable
install made before they existed sees them without reinstalling."""

ENVIRONMENTS = [
    "forgerl_plugins.environments.calculator:CalculatorEnvironment",
    "forgerl_plugins.environments.guess:GuessEnvironment",
]
