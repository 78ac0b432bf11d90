"""The verbs of `dtrain`: one module per command (``dtrain/__main__.py`` lists them in the order a
user meets them). Each adds its parser in ``configure(commands)`` and sets ``handler``; flags that two
verbs share are a module of their own (``allocation_flags.py``). The verbs turn flags into typed requests
for the modules they call, which know nothing of argparse.

Runs on the operator's machine. May import everything of ``dtrain`` (``local/`` only from the
``local`` and ``demo`` verbs); nothing imports it but ``dtrain/__main__.py`` and tests.
"""
