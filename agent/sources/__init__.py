"""Sources: the only code that reads hardware or OS state. Each has a live and a recorded form."""
