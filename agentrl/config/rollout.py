"""The sampling side of the config: the inference engines (and SGLang's server settings), the rollout
workers, and what they roll out: the env and the prompt data. Light: no torch or ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from agentrl.config.base import DEVICE, _Section, doc
from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.config import Config


class SGLangSection(_Section):
    key = "engine.sglang"
    python: Annotated[str, doc("Python interpreter that runs the SGLang server")] = "python3"
    args: Annotated[dict[str, Any], doc("extra SGLang server arguments (--key value), passed unchecked")] = {}
    startup_timeout_s: Annotated[float, doc("seconds a server may take to start", gt=0)] = 300.0
    restart_on_crash: Annotated[bool, doc("restart a crashed server")] = True
    max_restarts: Annotated[int, doc("restarts of a crashed server before the engine fails", ge=0)] = 5


class EngineSection(_Section):
    key = "engine"
    kind: Annotated[Literal["embedded", "sglang"], doc("inference engine")] = "embedded"
    num_engines: Annotated[int, doc("engine instances", ge=1)] = 1
    device: Annotated[str, doc("torch device of the engine: 'cpu', 'cuda', 'cuda:N'", pattern=DEVICE)] = "cpu"
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], doc("weights' dtype in the engine")] = (
        "float32"
    )
    max_batch_size: Annotated[int, doc("sequences decoded together", ge=1)] = 64
    max_seq_len: Annotated[int, doc("longest sequence (prompt + reply) in tokens", ge=1)] = 1024
    max_prefill_tokens: Annotated[int, doc("prompt tokens prefilled in one iteration", ge=1)] = 8192
    decode_steps: Annotated[
        int, doc("embedded: decode steps per iteration, one host sync (0: 8 on CUDA, 1 on CPU)", ge=0)
    ] = 0
    sampler: Annotated[
        Literal["auto", "torch", "triton"], doc("embedded: auto = fused Triton kernel on CUDA")
    ] = "auto"
    external_urls: Annotated[list[str], doc("already-running engine servers to use instead of starting")] = []
    request_timeout_s: Annotated[float, doc("seconds a generate request may take", gt=0)] = 300.0
    update_timeout_s: Annotated[float, doc("seconds a weight update may take", gt=0)] = 120.0
    update_mode: Annotated[
        Literal["auto", "keep", "abort", "wait"],
        doc(
            "running requests at a weight update; auto: abort for SGLang (its update waits for every "
            "running request), keep for the embedded engine"
        ),
    ] = "auto"
    sglang: Annotated[SGLangSection, doc("SGLang server settings")] = msgspec.field(
        default_factory=SGLangSection
    )

    def validate(self, cfg: Config | None = None) -> None:
        if self.kind == "sglang" and self.device == "cpu" and not self.external_urls:
            raise ConfigError("engine.kind = 'sglang' needs engine.device = 'cuda' or engine.external_urls")


class RolloutSection(_Section):
    key = "rollout"
    generator: Annotated[str, doc("registered generator or 'module:function'")] = "multi_turn"
    num_workers: Annotated[int, doc("rollout worker actors", ge=1)] = 1
    concurrency: Annotated[int, doc("episodes in flight per worker", ge=1)] = 32
    n_samples_per_prompt: Annotated[int, doc("samples per prompt (the group size)", ge=1)] = 8
    prompts_per_step: Annotated[int, doc("prompts per learner step", ge=1)] = 8
    max_new_tokens: Annotated[int, doc("tokens generated per turn", ge=1)] = 32
    max_turns: Annotated[int, doc("turns per episode", ge=1)] = 4
    temperature: Annotated[float, doc("sampling temperature", ge=0)] = 1.0
    top_p: Annotated[float, doc("nucleus sampling mass", gt=0, le=1)] = 1.0
    top_k: Annotated[int, doc("top-k sampling; -1 = off", ge=-1)] = -1
    dynamic_sampling: Annotated[
        bool, doc("drop groups whose rewards agree (agentrl.rewards.dynamic_sampling)")
    ] = False
    max_oversample: Annotated[
        float,
        doc(
            "with dynamic_sampling: at most this many times prompts_per_step tasks may finish between two learner "
            "steps without a batch's worth of informative groups; past it the run stops, naming this field",
            ge=1,
        ),
    ] = 4.0
    agent: Annotated[
        str,
        doc(
            "openai_proxy generator: 'module:function' agent (default agentrl.generators.proxy_agent:env_agent)"
        ),
    ] = ""
    tool_parser: Annotated[
        Literal["", "hermes", "qwen", "qwen2.5", "qwen3", "qwen3_coder"],
        doc("openai_proxy / external generators: how the proxy reads tool calls in a reply (hermes: "
            "`<tool_call>{json}</tool_call>`, Qwen2.5/Qwen3; qwen3_coder: `<function=NAME><parameter=P>`); "
            "\"\": chosen by the chat template"),
    ] = ""  # fmt: skip
    abort_retries: Annotated[
        int,
        doc("times a reply cut by a weight update (engine.update_mode = 'abort') is continued from its partial "
            "output within one turn before the episode ends aborted", ge=0),
    ] = 3  # fmt: skip
    proxy_sampling: Annotated[
        Literal["refuse", "record", "override"],
        doc("OpenAI proxy: a request's temperature/top_p that differ from the run's are refused (400), "
            "sampled with and recorded per turn in the trajectory's metadata (record), or replaced by the "
            "run's and recorded as asked (override: for clients that always send their own)"),
    ] = "refuse"  # fmt: skip
    proxy_host: Annotated[
        str, doc("openai_proxy / external generators: address their HTTP servers listen on (port: any free)")
    ] = "127.0.0.1"
    proxy_token: Annotated[
        str, doc("openai_proxy / external generators: bearer token clients must send; required off loopback")
    ] = ""
    external_timeout_s: Annotated[
        float,
        doc(
            "external generator: seconds a claimed task may go without a request from its agent before it "
            "ends as an aborted trajectory",
            gt=0,
        ),
    ] = 300.0
    proxy_keep_side_requests: Annotated[
        bool,
        doc("OpenAI proxy: keep a session's side requests (title / summary calls, abandoned branches) as their "
            "own trajectories, flagged metadata.side_request, rather than drop them from training"),
    ] = False  # fmt: skip


class EnvSection(_Section):
    key = "env"
    name: Annotated[str, doc("a registered env (`agentrl envs` lists them)")] = "guess_number"
    kwargs: Annotated[dict[str, Any], doc("passed to the env's constructor")] = {}
    reward: Annotated[str, doc("env's reward instead: 'exact_match', 'math' or 'module:function'")] = ""


class DataSection(_Section):
    key = "data"
    path: Annotated[str, doc("JSONL or Parquet prompts; empty: the env generates tasks (sample_tasks)")] = ""
    eval_path: Annotated[str, doc("JSONL or Parquet evaluation prompts; empty: the env's")] = ""
    input_key: Annotated[str, doc("record key holding the prompt")] = "prompt"
    label_key: Annotated[str, doc("record key holding the answer")] = "answer"
    metadata_key: Annotated[str, doc("record key passed to the env as metadata; empty = none")] = ""
    apply_chat_template: Annotated[bool, doc("wrap prompts in the tokenizer's chat template")] = True
    shuffle: Annotated[bool, doc("shuffle the prompts every epoch")] = True
    seed: Annotated[int, doc("seed of the shuffle", ge=0)] = 0
    epochs: Annotated[int, doc("passes over the prompts", ge=1)] = 1
