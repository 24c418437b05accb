"""Deployment: turning a checkpoint into a running (or shipped) model; may import every part below the CLI except ``kiln.bench``.

- ``compress_job``: compress a checkpoint to an accuracy budget and save it.
- ``generate_job``: run a generation request on one process or on tensor/pipeline-parallel
  ranks (``GenerateRequest`` -> ``GenerateResult``).
- ``parse``: the user-facing value formats (budgets such as "1%", objectives, option lists,
  layer splits), each with a clear error.
- ``multinode``: the torchrun line for ranks on several machines.
- ``bandwidth``: the weight-streaming figures a generation result is reported with.
- The planner (``kiln plan``): ``architecture`` (a model's shape from a checkpoint or a
  config file), ``hardware`` (the device catalog and spec strings), ``estimate`` (memory and
  time of one layout), ``planner`` (the joint search, explanations, relaxations), ``mixed``
  (per-layer INT8/INT4 mixes from the compression allocator as candidate formats;
  ``mixed_measure``: their calibration on a checkpoint and the mixes measured on it),
  ``plan_schema`` (the versioned plan document), ``plan_job`` (what the CLI calls).
"""
