"""Parallel execution on torch.distributed (launching ranks, tensor and pipeline parallel); may import kiln.core, kernels, compress, quality, models and llm.

    from kiln.parallel import run_parallel
    tokens = run_parallel(model_factory, prompt_ids, 32, tp=2, pp=2, sampling=sampling).tokens

``launch`` starts and watches the ranks (``launch.py``; torchrun for several machines),
``tp.py`` shards a ``Transformer`` across a tensor-parallel group (or names the slices a
rank's streaming load reads), ``pp.py`` splits it into pipeline stages and runs them,
micro-batched, as a ``Decoder`` of ``kiln.llm.generate``, ``mesh.py`` puts them together
(``PartLoader``: each rank reads only its part of the checkpoint).
"""

from kiln.parallel.launch import RankFailed, launch, progress, torchrun_command
from kiln.parallel.mesh import (
    Mesh,
    ParallelRun,
    PartLoader,
    RankPart,
    RankReport,
    rank_generate,
    run_parallel,
    run_parallel_job,
)
from kiln.parallel.pp import PipelineDecoder, Stage, split_stages
from kiln.parallel.tp import (
    Sliceable,
    block_slices,
    finish_block,
    partition_heads,
    shard_tensor_parallel,
    sliceable,
)

__all__ = [
    "Mesh",
    "ParallelRun",
    "PartLoader",
    "PipelineDecoder",
    "RankFailed",
    "RankPart",
    "RankReport",
    "Sliceable",
    "Stage",
    "block_slices",
    "finish_block",
    "launch",
    "partition_heads",
    "progress",
    "rank_generate",
    "run_parallel",
    "run_parallel_job",
    "shard_tensor_parallel",
    "sliceable",
    "split_stages",
    "torchrun_command",
]
