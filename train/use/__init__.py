"""Using a trained surrogate: load it in a script (``Surrogate``), predict files (``python -m train predict``),
export it to run without this package (``python -m train export``)."""
