"""`results RUN`: download what a run left in the results container.

The verb's parser and handler live with the download, in dtrain/jobs/results.py; this module is its
entry in the list of verbs.
"""

from dtrain.jobs.results import configure

__all__ = ["configure"]
