"""Building one image: the inputs, the decisions, the layers, the image value.

    inputs.py      BuildInputs (definition, pin, SM, catalogue) loaded and checked once; the
                   destination rule
    prepare.py     resolve the base, read its vLLM, patch it, decide kiln's layers and labels
    layers.py      what a layer holds (LayerContents), the audit file, the deterministic tar
    provenance.py  kiln's commit and public URL, for labels and the audit file
    image.py       BuiltImage: the one value every publisher writes (``bake``)

``kiln.pipeline.run_build`` runs them and hands the image to ``kiln.publish``.
"""
