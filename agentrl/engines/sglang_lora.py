"""LoRA versions on an SGLang server: one adapter name per policy version, routed by `lora_path`.

SGLang 0.5.12, launched with `--enable-lora --max-lora-rank R --lora-target-modules ...`
(`sglang_launcher.lora_server_args`), loads a PEFT adapter directory at run time with
`POST /load_lora_adapter {"lora_name", "lora_path", "pinned"}` (answer `{"success", "error_message",
"loaded_adapters"}`, HTTP 400 on failure) and drops it with `POST /unload_lora_adapter {"lora_name"}`; a
`/generate` request names its adapter in `lora_path`. SGLang binds a request to its adapter when the request
arrives, so a request runs wholly on the version it was sent with: its tokens are stamped with that version
(SGLang's `weight_version` belongs to the base weights and does not move). `LoraVersions` is the client's
book: the current (name, version), how many requests each name has in flight, and which retired name can be
unloaded now; the previous version is unloaded once its last request has returned.
"""

from __future__ import annotations


def adapter_name(version: int) -> str:
    return f"agentrl-v{version}"


class LoraVersions:
    def __init__(self) -> None:
        self.current: tuple[str, int] | None = None
        self.in_flight: dict[str, int] = {}
        self.retired: set[str] = set()

    def acquire(self) -> tuple[str, int] | None:
        """The (name, version) a new request runs on, counted in flight; None before the first adapter."""
        if self.current is not None:
            self.in_flight[self.current[0]] = self.in_flight.get(self.current[0], 0) + 1
        return self.current

    def release(self, name: str) -> str | None:
        """A request on `name` returned: the name to unload now (a retired one whose last request this was)."""
        left = self.in_flight[name] - 1
        if left:
            self.in_flight[name] = left
            return None
        del self.in_flight[name]
        if name in self.retired:
            self.retired.discard(name)
            return name
        return None

    def switch(self, version: int) -> str | None:
        """`version`'s adapter is loaded and current: the previous name to unload now (None if it still has
        requests in flight: `release` hands it over after the last one)."""
        old, self.current = self.current, (adapter_name(version), version)
        if old is None or old[0] == self.current[0]:
            return None
        if self.in_flight.get(old[0]):
            self.retired.add(old[0])
            return None
        return old[0]
