"""What a job is asked to do, before any framework is imported: the flags (``args``), the typed settings
built once from them (``settings``), and the framework-free vocabulary they are made of: synchronisation
modes (``sync``), the parallel layout (``layout``), pipeline schedules (``pipeline_schedules``),
activation-checkpointing modes (``activation_checkpointing``) and the models' names and shapes (``models``).

Runs wherever a job runs. Standard library only: imports no framework (torch, tensorflow, horovod, keras)
at module level and nothing of ``training.torch`` or ``training.tf``; may import ``training.errors``,
``training.exit_status`` and ``training.world`` (tests/test_layout.py checks it).
"""
