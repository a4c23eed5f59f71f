"""The recipes' one error type: every room of ``recipes/`` raises it, so it lives below all of them."""


class RecipeError(ValueError):
    """A problem with the run's inputs, reported before any training starts."""
