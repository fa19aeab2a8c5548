"""RACER's lossless speculative decoding as a Hugging Face ``custom_generate`` recipe.

``model.generate(**inputs, custom_generate="<this repository or folder>", trust_remote_code=True,
racer_method="racer")`` gives exactly what ``generate`` gives, faster: see README.md.
The work is done by the installed ``racer`` package (requirements.txt).
"""

from racer.hf import hub_generate


def generate(model, **kwargs):
    """``generate``'s own arguments, decoded by racer (``racer_method``: ``racer``,
    ``pld``, ``rest``, ``token-recycling``, ``logitspec`` or ``none``, with options such
    as ``racer:capacity=16``)."""
    return hub_generate(model, **kwargs)
