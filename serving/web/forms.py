"""The Load form: what an operator fills in, parsed into request_load's arguments."""
from __future__ import annotations

import shlex

from django import forms

from serving.adapters import ADAPTERS


class ExtraArgsError(ValueError):
    pass


def parse_extra_args(text: str) -> dict[str, object]:
    """One `--flag value`, `--flag` or `key=value` per line -> {flag: value}; a bare flag is True."""
    out: dict[str, object] = {}
    for n, raw in enumerate((text or "").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith("-") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
            continue
        if line.startswith("-") and "=" in line.split()[0]:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
            continue
        try:
            parts = shlex.split(line)
        except ValueError as exc:
            raise ExtraArgsError(f"line {n}: {exc}") from None
        if len(parts) == 1:
            out[parts[0]] = True
        elif len(parts) == 2:
            out[parts[0]] = parts[1]
        else:
            raise ExtraArgsError(f"line {n}: one flag and at most one value per line ({line[:60]!r})")
    return out


def parse_adapters(text: str) -> list[dict]:
    """The Load dialog's adapters, one per line: `name path [scale]` (checked by the load itself)."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) not in (2, 3):
            raise ValueError(f"line {number}: give name, path and an optional scale")
        try:
            scale = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            raise ValueError(f"line {number}: the scale {parts[2][:20]!r} is not a number") from None
        out.append({"name": parts[0], "path": parts[1], "scale": scale})
    return out


class LoadForm(forms.Form):
    model_path = forms.CharField(max_length=1024, label="Model (store prefix, or absolute path on the node under XGEN_IMPORT_DIRS)")
    model_name = forms.CharField(max_length=128, required=False, label="Served name (what clients put in model)")
    server_type = forms.ChoiceField(choices=[("llm", "LLM (chat, completions)"), ("embedding", "Embedding"),
                                             ("rerank", "Reranker (rerank, score)")],
                                    initial="llm", label="Type")
    backend = forms.ChoiceField(choices=[("auto", "auto")] + [(n, n) for n in ADAPTERS], initial="auto")
    node = forms.CharField(max_length=100, required=False)
    gpus = forms.TypedMultipleChoiceField(coerce=int, required=False, choices=[], label="GPUs")
    tensor_parallel_size = forms.IntegerField(min_value=1, max_value=64, initial=1, required=False)
    extra_args = forms.CharField(widget=forms.Textarea(attrs={"rows": 4, "placeholder": "--ctx-size 8192\n--flash-attn on"}),
                                 required=False, max_length=8000,
                                 label="Extra arguments (one --flag value per line, or key=value)")
    adapters = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "pirate lora/pirate 1.0"}),
        required=False, max_length=8000,
        label="LoRA adapters (one per line: name path [scale]); each is served as <served name>:<name>",
        help_text="The path is an adapter in the store (lora/<name>: each node copies it with the model) or an "
                  "absolute path on the node. llama-server takes a LoRA GGUF of the same architecture, vLLM a PEFT "
                  "folder. To change the set later, load again (on llama-server the engine restarts with the new "
                  "set).")
    preset = forms.CharField(max_length=64, required=False, label="Engine preset")
    autostart = forms.BooleanField(required=False, label="Start when the node agent starts (the console is ready "
                                                         "once it is; without it, a clean agent stop leaves it stopped)")
    policy = forms.ChoiceField(choices=[("always", "always: runs until unloaded"),
                                        ("on_demand", "on demand: starts on the first request, unloads when idle")],
                               initial="always", required=False, label="Policy")
    idle_ttl_s = forms.IntegerField(min_value=0, max_value=10**7, required=False, label="Idle TTL (seconds)",
                                    help_text="on demand: unloaded after this long without a request; 0 = never; "
                                              "empty: the default (XGEN_IDLE_TTL_S)")
    pinned = forms.BooleanField(required=False, label="Pinned: never evicted to make room for another model")
    max_concurrency = forms.IntegerField(min_value=1, max_value=100000, required=False, label="Max concurrency",
                                         help_text="requests one replica serves at once; more wait in the queue; "
                                                   "empty: no limit")
    fallback = forms.BooleanField(required=False, label="If a backend named above does not come up, try another "
                                  "(automatic choices always do)")

    def __init__(self, *args, gpu_choices: list[tuple[int, str]] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["gpus"].choices = gpu_choices or []

    def clean_policy(self) -> str:
        return self.cleaned_data.get("policy") or "always"

    def clean_adapters(self) -> list[dict]:
        try:
            return parse_adapters(self.cleaned_data.get("adapters") or "")
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean_extra_args(self) -> dict:
        try:
            return parse_extra_args(self.cleaned_data.get("extra_args") or "")
        except ExtraArgsError as exc:
            raise forms.ValidationError(str(exc)) from None
