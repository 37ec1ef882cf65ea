"""The run configuration: its model and sections, the bounds on what it may ask for,
where its values come from, the kinds of backend it names, forgerl's environment switches.
Imports no plugin machinery (the interfaces import it).
"""
