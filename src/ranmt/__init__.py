"""ranmt: neural machine translation with pluggable attention, centred on Recurrent Attention.

Python API::

    from ranmt import Translator
    Translator.load("runs/my_run").translate(["A man rides a bike."])
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy import keeps `import ranmt` (and the CLI's --help) fast.
    if name == "Translator":
        from ranmt.inference.translator import Translator

        return Translator
    raise AttributeError(name)


__all__ = ["Translator", "__version__"]
