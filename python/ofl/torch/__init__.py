"""ofl from PyTorch.

Interfaces (python/README.md has the details and the mapping onto ofl):

* Megatron-Core's fine-grained activation offloading API, same names:
  :func:`fine_grained_offloading_group_start`,
  :func:`fine_grained_offloading_group_commit`, :func:`init_chunk_handler`,
  :class:`PipelineOffloadManager`, :class:`FineGrainedActivationOffloadingInterface`, ...
* :func:`offload_activations`: a torchtune-style context manager/decorator;
  torchtune's names (:class:`OffloadActivations`, :class:`NoOpManager`,
  :func:`get_act_offloading_ctx_manager`) in :mod:`ofl.torch.torchtune`,
  Axolotl's (``get_lora_act_offloading_ctx_manager``, trl's
  ``get_act_offloading_ctx_manager``, ``Disco``) in :mod:`ofl.torch.axolotl`.
* :func:`disk_checkpoint`: recompute a function in backward, its inputs kept on
  ofl's disk tier meanwhile; :class:`Disco` is Axolotl's calling convention.
* :func:`save_safetensors` / :func:`load_safetensors` and :class:`AsyncStager`
  (torch.distributed.checkpoint) over ofl's writer, reader and stager.

ofl errors are raised as :class:`ofl.OflError` (status, ofl_status_str and
ofl_last_error in the message).
"""
from .._errors import OflError  # noqa: F401
from ._core import Runtime  # noqa: F401
from .megatron import (  # noqa: F401
    PipelineOffloadManager, FineGrainedActivationOffloadingInterface,
    fine_grained_offloading_group_start, fine_grained_offloading_group_commit,
    fine_grained_offloading_group_offload, fine_grained_offloading_group_flush_delayed_groups,
    fine_grained_offloading_disable_offload, fine_grained_offloading_enable_offload,
    fine_grained_offloading_forward_record, fine_grained_offloading_backward_record,
    init_chunk_handler, flush_delayed_groups, mark_not_offloadable, mark_not_offload,
    disable_offload, enable_offload, forward_record, backward_record, reset, get_context)
from .offload import offload_activations, OffloadActivations  # noqa: F401
from .checkpoint import save_safetensors, load_safetensors, AsyncStager  # noqa: F401
from .disk import disk_checkpoint, DiskStore, Disco  # noqa: F401
from .torchtune import NoOpManager, get_act_offloading_ctx_manager  # noqa: F401
