"""The in-container launcher: environment -> launch plan -> exec. Standard library only."""
