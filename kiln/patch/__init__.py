"""Patches as libcst codemods: the model, the catalogue, the engine and the verdict record."""
