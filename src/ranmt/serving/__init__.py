"""``ranmt serve``: the FastAPI application (``app``), its request schema, batchers, decoding
workers, limits and the attention explorer's static files (``explorer/``).

Nothing is imported here: ``ranmt.serving.limits`` is read when the command line is built,
which must not import FastAPI or torch."""
