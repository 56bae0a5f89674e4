"""tipsito: TIPSv2 + ITO vision-language pretraining in JAX/Flax.

`tipsito.load(dir)` is exposed lazily (module __getattr__) so that importing
the package stays cheap and does not pull in JAX/Orbax for tools that only
need configs or data code.
"""


def __getattr__(name):
  """Lazy attributes: `load` -> tipsito.inference.load."""
  if name == 'load':
    from tipsito.inference import load  # lazy: `import tipsito` must not import JAX/Orbax (docstring)

    return load
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
