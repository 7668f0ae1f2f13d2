"""`harness view`, the top layer: a local page over the store (`app.py`, the page itself in `static/`)."""

from harness.viewer.app import Viewer, create_app

__all__ = ["Viewer", "create_app"]
