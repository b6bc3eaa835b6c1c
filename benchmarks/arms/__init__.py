"""The arms under test and how each is started (the Stack)."""
