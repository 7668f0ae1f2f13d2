"""The ground layer, importing nothing else of ours: the records every layer passes (`records.py`), a call's flags
(`flags.py`), and the merger that turns an episode's calls into training samples (`merge.py`)."""
