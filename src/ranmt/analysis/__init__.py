"""Looking inside trained models: attention statistics (``stats``), their collection over a
data split (``collect``) and the papers' figures (``plots``). Entry point: ``analyze``."""

from ranmt.analysis.collect import analyze

__all__ = ["analyze"]
