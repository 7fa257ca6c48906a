"""The command line and the settings it is generated from: ``epochal``'s parser, the settings
file, option types and suggestions for a misspelt option."""
