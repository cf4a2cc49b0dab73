"""icl_book: a context moved into the weights, exactly (Dherin et al., arXiv 2507.16003).

A contextual block run with a context equals the block run without it but with
its MLP's first weight matrix patched by a rank-1 update. One import serves
every model, a toy block or stack of this package or a `transformers` model::

    import icl_book as icl
    model, tok = icl.load_pretrained('smollm2')
    P = icl.context_patches(model, "France: Paris. Japan: Tokyo.", " Italy:", tokenizer=tok)
    with icl.patched(model, P):                  # the query alone sees the context
        ...

The top-level names are read from their modules when first used, so that
`import icl_book` imports neither torch nor transformers. This file is written
by hand (no chapter exports it); `nbdev-export` leaves it unchanged.
"""
__version__ = "0.1.0"

_HOMES = {   # top-level name -> the module that defines it
    'context_patches': 'front', 'patched': 'front', 'load_patches': 'front',
    'patch_errors': 'front', 'generate_without_context': 'front',
    'token_updates': 'front', 'supported': 'front',
    'load_pretrained': 'weights', 'tiny_model': 'families',
    'RankOne': 'blocks', 'PATCH_MODES': 'deep',
    'fit_adapter': 'compress', 'Compressed': 'compress',
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    "The top-level name `name`, imported from its module on first use."
    if name not in _HOMES:
        raise AttributeError(f"module 'icl_book' has no attribute {name!r}; "
                             f"its top-level names are {sorted(_HOMES)}")
    import importlib
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(__all__) | {'__version__'})
