"""Daemon configuration: precedence, parsing, validation messages, the example file, the shm check."""

import argparse
import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon.config import (
    GiB,
    ConfigError,
    DaemonConfig,
    add_serve_arguments,
    config_from_args,
    env_name,
    load_config,
)
from ckptd.daemon.handoff.shm_dir import ShmBudget, check_shm, host_memory_bytes

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "ckptd.example.toml"
FIELDS = [f.name for f in dataclasses.fields(DaemonConfig)]
BASE_ENV = {"XDG_RUNTIME_DIR": "/run/user/1000", "XDG_DATA_HOME": "/home/u/.data"}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ckptd.toml"
    path.write_text(text)
    return path


def parse_serve(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


# ------------------------------------------------------------------ defaults


def test_defaults_need_no_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    config = load_config({}, BASE_ENV, None)
    assert config == DaemonConfig(root=Path("/home/u/.data/ckptd"), socket=Path("/run/user/1000/ckptd/ckptd.sock"))
    assert (config.shm_dir, config.arena_policy, config.max_inflight) == (Path("/dev/shm"), "wait", 2)
    assert (config.keep_last, config.keep_every, config.write_threads) == (3, 0, 4)
    assert (config.max_file_bytes, config.save_timeout_s) == (4 * GiB, 600.0)
    assert (config.log_level, config.log_json) == ("info", False)


@pytest.mark.parametrize(
    ("euid", "environ", "root", "socket"),
    [
        (0, {}, "/var/lib/ckptd", "/run/ckptd/ckptd.sock"),
        (0, {"XDG_RUNTIME_DIR": "/run/user/0"}, "/var/lib/ckptd", "/run/user/0/ckptd/ckptd.sock"),
        (1000, {"XDG_DATA_HOME": "/d"}, "/d/ckptd", "/tmp/ckptd-1000/ckptd.sock"),
        (1000, {"HOME": "/ignored", "XDG_DATA_HOME": "/d", "XDG_RUNTIME_DIR": "/r"}, "/d/ckptd", "/r/ckptd/ckptd.sock"),
    ],
)
def test_default_locations(monkeypatch: pytest.MonkeyPatch, euid: int, environ: dict[str, str], root: str, socket: str) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    config = load_config({}, environ, None)
    assert (config.root, config.socket) == (Path(root), Path(socket))


# ------------------------------------------------------------------ precedence


@pytest.mark.parametrize("in_file", [False, True])
@pytest.mark.parametrize("in_env", [False, True])
@pytest.mark.parametrize("in_flag", [False, True])
def test_flags_beat_environment_beat_file_beat_defaults(tmp_path: Path, in_file: bool, in_env: bool, in_flag: bool) -> None:
    path = write(tmp_path, "max_inflight = 3\n") if in_file else None
    environ = {**BASE_ENV, **({"CKPTD_MAX_INFLIGHT": "4"} if in_env else {})}
    flags = {"max_inflight": "5" if in_flag else None}
    expected = 5 if in_flag else 4 if in_env else 3 if in_file else 2
    assert load_config(flags, environ, path).max_inflight == expected


def test_sources_mix_per_setting(tmp_path: Path) -> None:
    path = write(tmp_path, 'root = "/file/root"\nkeep_every = 100\n[retention]\nkeep_last = 7\n')
    environ = {**BASE_ENV, "CKPTD_KEEP_LAST": "9", "CKPTD_LOG_LEVEL": "DEBUG"}
    config = load_config({"root": "/flag/root", "write_threads": None}, environ, path)
    assert (config.root, config.keep_last, config.keep_every, config.log_level) == (Path("/flag/root"), 9, 100, "debug")
    assert config.write_threads == 4


def test_config_file_from_environment_and_flag(tmp_path: Path) -> None:
    from_env = write(tmp_path, "keep_last = 11\n")
    from_flag = tmp_path / "other.toml"
    from_flag.write_text("keep_last = 12\n")
    environ = {**BASE_ENV, "CKPTD_CONFIG": str(from_env)}
    assert load_config({}, environ, None).keep_last == 11
    assert config_from_args(parse_serve(), environ).keep_last == 11
    assert config_from_args(parse_serve("--config", str(from_flag)), environ).keep_last == 12


def test_empty_environment_values_count_as_unset() -> None:
    environ = {**BASE_ENV, "CKPTD_MAX_INFLIGHT": "", "CKPTD_CONFIG": ""}
    assert load_config({}, environ, None).max_inflight == 2


# ------------------------------------------------------------------ every setting from every source

# field, text (flag / environment), TOML literal, expected value
SETTINGS: list[tuple[str, str, str, Any]] = [
    ("root", "/srv/ckpt", '"/srv/ckpt"', Path("/srv/ckpt")),
    ("socket", "/run/x/d.sock", '"/run/x/d.sock"', Path("/run/x/d.sock")),
    ("shm_dir", "/dev/shm/ckptd", '"/dev/shm/ckptd"', Path("/dev/shm/ckptd")),
    ("arena_policy", "skip", '"skip"', "skip"),
    ("max_inflight", "4", "4", 4),
    ("shm_budget", "64GiB", '"64GiB"', ShmBudget(nbytes=64 << 30)),  # issue 30 finding 5: bytes,
    ("shm_budget", "1073741824", "1073741824", ShmBudget(nbytes=1 << 30)),
    ("shm_budget", "50%", '"50%"', ShmBudget(share=0.5)),  # a share of the host's memory,
    ("shm_budget", "12.5 %", '"12.5%"', ShmBudget(share=0.125)),
    ("shm_budget", "0", "0", ShmBudget()),  # or none
    ("hold_while_saving", "yes", "true", True),
    ("idle_release_s", "90", "90", 90.0),
    ("idle_release_s", "0", "0", 0.0),
    ("keep_last", "0", "0", 0),
    ("keep_every", "1000", "1000", 1000),
    ("write_threads", "16", "16", 16),
    ("max_file_bytes", "512MiB", '"512MiB"', 512 << 20),
    ("max_file_bytes", "1048576", "1048576", 1 << 20),
    ("link_unchanged", "false", "false", False),
    ("save_timeout_s", "20", "20", 20.0),
    ("save_timeout_s", "0.5", "0.5", 0.5),
    ("write_throttle", "2MiB", '"2MiB"', 2 << 20),
    ("write_throttle", "0", "0", 0),
    ("disk_reserve", "10GiB", '"10GiB"', 10 << 30),
    ("disk_reserve", "0", "0", 0),
    ("background_nice", "19", "19", 19),
    ("background_nice", "0", "0", 0),
    ("background_ionice", "Idle", '"idle"', "idle"),
    ("background_ionice", "off", '"off"', "off"),
    ("background_cpus", "0", "[0]", (0,)),
    ("background_cpus", "0,0", '"0"', (0,)),
    ("background_cpus", "", '""', ()),
    ("log_level", "WARNING", '"warning"', "warning"),
    ("log_json", "true", "true", True),
    ("log_json", "0", "false", False),
    ("node_rank", "0", "0", 0),
    ("peers", "node0:7070", '["node0:7070"]', ("node0:7070",)),
    ("peer_token", "0123456789abcdef", '"0123456789abcdef"', "0123456789abcdef"),
    ("keep_best", "2", "2", 2),
    ("best_mode", "MAX", '"max"', "max"),
    ("metrics_port", "9477", "9477", 9477),
    ("metrics_host", "127.0.0.1", '"127.0.0.1"', "127.0.0.1"),
    ("health_port", "9478", "9478", 9478),
    ("quantize", "o2", '"O2"', "O2"),
    ("quantize", "None", '"none"', "none"),
    ("master_weights", "Residual", '"residual"', "residual"),
    ("quant_max_generations", "0", "0", 0),
    ("replicas", "2", "2", 2),
    ("replica_bandwidth", "100MiB", '"100MiB"', 100 * 2**20),
    ("replica_memory", "1GiB", '"1GiB"', 2**30),
    ("replica_port", "7071", "7071", 7071),
    ("replica_prefetch", "no", "false", False),
    ("load_broadcast", "OFF", '"off"', "off"),
    ("remote", "s3://bkt/ckpt/run/", '"s3://bkt/ckpt/run"', "s3://bkt/ckpt/run"),
    ("remote_streams", "32", "32", 32),
    ("remote_part_bytes", "8MiB", '"8MiB"', 8 * 2**20),
    ("remote_keep_last", "5", "5", 5),
    ("remote_keep_every", "100", "100", 100),
]


TOKEN = "0123456789abcdef"
BUDGET_EXPECTED = "0 (none), a size in bytes such as '64GiB' (B, KiB, MiB, GiB or TiB), or a share of the host's memory such as '50%'"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"node_rank": "1"}, "--node-rank 1 needs --peers"),
        ({"node_rank": "2", "peers": "a:1,b:2", "peer_token": TOKEN}, "not a position in --peers"),
        ({"peers": "a:1,a:1", "peer_token": TOKEN}, "lists an address twice"),
        ({"peers": "a:1,b:2"}, "shared secret of at least 16 characters"),
        ({"peers": "a:1,b:2", "peer_token": "short"}, "shared secret"),
        ({"peers": "a,b:2", "peer_token": TOKEN}, "'a' is not host:port"),
        ({"peers": "a:99999", "peer_token": TOKEN}, "is not host:port"),
    ],
)
def test_bad_multi_node_settings_say_what_to_fix(given: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(given, BASE_ENV, None)


def test_several_nodes_and_the_token_from_the_environment() -> None:
    config = load_config({"node_rank": "1", "peers": "n0:7070, n1:7070"}, {**BASE_ENV, "CKPTD_PEER_TOKEN": TOKEN}, None)
    assert config.multi_node and config.peer_address == "n1:7070" and config.peer_token == TOKEN
    assert TOKEN not in repr(config)


TLS_FIELDS = ("peer_tls_cert", "peer_tls_key", "peer_tls_ca")  # only together: tested below


def test_every_field_is_covered() -> None:
    assert {f for f, *_ in SETTINGS} | set(TLS_FIELDS) == set(FIELDS)


def test_the_peer_tls_files_come_together_from_each_source(tmp_path: Path) -> None:
    paths = {f: f"/etc/ckptd/{f}.pem" for f in TLS_FIELDS}
    expected = tuple(Path(paths[f]) for f in TLS_FIELDS)
    assert load_config(paths, BASE_ENV, None).peer_tls_files == expected
    assert load_config({}, {**BASE_ENV, **{env_name(f): v for f, v in paths.items()}}, None).peer_tls_files == expected
    toml = "".join(f'{f} = "tls/{f}.pem"\n' for f in TLS_FIELDS)  # relative to the file's directory
    from_file = load_config({}, BASE_ENV, write(tmp_path, toml)).peer_tls_files
    assert from_file == tuple(tmp_path / "tls" / f"{f}.pem" for f in TLS_FIELDS)
    assert load_config({}, BASE_ENV, None).peer_tls_files is None


def test_a_peer_tls_file_alone_says_which_are_missing() -> None:
    with pytest.raises(ConfigError, match="--peer-tls-cert without --peer-tls-key, --peer-tls-ca"):
        load_config({"peer_tls_cert": "/etc/ckptd/node.crt"}, BASE_ENV, None)


@pytest.mark.parametrize(("field", "text", "toml", "expected"), SETTINGS)
def test_each_source_sets_each_field(tmp_path: Path, field: str, text: str, toml: str, expected: Any) -> None:
    assert getattr(load_config({}, {**BASE_ENV, env_name(field): text}, None), field) == expected
    assert getattr(load_config({field: text}, BASE_ENV, None), field) == expected
    assert getattr(load_config({}, BASE_ENV, write(tmp_path, f"{field} = {toml}\n")), field) == expected


def test_every_field_has_a_flag() -> None:
    ns = parse_serve()
    assert all(getattr(ns, name) is None for name in FIELDS) and ns.config is None
    ns = parse_serve("--save-timeout", "20", "--max-file-bytes", "1GiB", "--no-log-json", "--arena-policy", "skip")
    config = config_from_args(ns, {**BASE_ENV, "CKPTD_LOG_JSON": "yes"})
    assert (config.save_timeout_s, config.max_file_bytes, config.log_json, config.arena_policy) == (20.0, GiB, False, "skip")
    assert config_from_args(parse_serve("--log-json"), BASE_ENV).log_json is True


def test_paths_expand_home_and_file_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'root = "data"\nshm_dir = "~/shm"\n')
    config = load_config({"socket": "rel/d.sock"}, BASE_ENV, path)
    assert config.root == tmp_path / "data"
    assert config.shm_dir == Path("~/shm").expanduser()
    assert config.socket == Path("rel/d.sock")  # a flag is relative to the working directory, as typed


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", 1), ("4GiB", 4 * GiB), ("512 MiB", 512 << 20), ("1.5GiB", 3 * GiB // 2), ("64kib", 64 << 10), ("100B", 100), ("2TiB", 2 << 40)],
)
def test_sizes(text: str, expected: int) -> None:
    assert load_config({"max_file_bytes": text}, BASE_ENV, None).max_file_bytes == expected


# ------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    ("field", "text", "expected"),
    [
        ("max_inflight", "x", "an integer >= 1"),
        ("max_inflight", "0", "an integer >= 1"),
        ("max_inflight", "2.5", "an integer >= 1"),
        ("keep_last", "-1", "an integer >= 0 (0 = keep all)"),
        ("keep_every", "ten", "an integer >= 0 (0 = off)"),
        ("write_threads", "0", "an integer >= 1"),
        ("arena_policy", "drop", "one of 'wait', 'skip'"),
        ("log_level", "verbose", "one of 'debug', 'info', 'warning', 'error', 'critical'"),
        ("log_json", "maybe", "true or false"),
        ("save_timeout_s", "0", "a number of seconds > 0"),
        ("save_timeout_s", "inf", "a number of seconds > 0"),
        ("save_timeout_s", "soon", "a number of seconds > 0"),
        ("max_file_bytes", "4GB", "a size in bytes >= 1"),
        ("max_file_bytes", "0", "a size in bytes >= 1"),
        ("max_file_bytes", "1.5", "a size in bytes >= 1"),
        ("max_file_bytes", "-1GiB", "a size in bytes >= 1"),
        # issue 30 finding 5: the budget says which spellings it takes
        ("shm_budget", "lots", BUDGET_EXPECTED),
        ("shm_budget", "64GB", BUDGET_EXPECTED),
        ("shm_budget", "-1GiB", BUDGET_EXPECTED),
        ("shm_budget", "150%", f"{BUDGET_EXPECTED}; '150%' is not a percentage above 0 and at most 100"),
        ("shm_budget", "0%", f"{BUDGET_EXPECTED}; '0%' is not a percentage above 0 and at most 100"),
        ("shm_budget", "half%", f"{BUDGET_EXPECTED}; 'half%' is not a percentage above 0 and at most 100"),
        ("idle_release_s", "-1", "a number of seconds > 0, or 0 (off)"),
        ("idle_release_s", "an hour", "a number of seconds > 0, or 0 (off)"),
        # issue 33: the background threads' priority
        ("background_nice", "20", "an integer from 0 (off) to 19"),
        ("background_nice", "-5", "an integer from 0 (off) to 19"),
        ("background_nice", "low", "an integer from 0 (off) to 19"),
        ("background_ionice", "realtime", "one of 'best-effort', 'idle', 'off'"),
        ("background_cpus", "two", "a CPU list such as '2-3' or '0,2,4' (empty: unset); CPU list 'two': 'two' is not a CPU number or range"),
        ("background_cpus", "3-1", "a CPU list such as '2-3' or '0,2,4' (empty: unset); CPU list '3-1': '3-1' is not a CPU number or an ascending range"),
        ("background_cpus", "100000", "a CPU list such as '2-3' or '0,2,4' (empty: unset); --background-cpus: CPU(s) 100000 are not among the CPUs this daemon may use"),
    ],
)
def test_bad_values_name_the_source(field: str, text: str, expected: str) -> None:
    env = env_name(field)
    with pytest.raises(ConfigError) as from_env:
        load_config({}, {**BASE_ENV, env: text}, None)
    assert str(from_env.value).startswith(f"{env}={text!r}: expected {expected}")
    with pytest.raises(ConfigError, match=re.escape(f"={text!r}: expected {expected}")) as from_flag:
        load_config({field: text}, BASE_ENV, None)
    assert str(from_flag.value).startswith("--")


def test_the_documented_message() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config({}, {**BASE_ENV, "CKPTD_MAX_INFLIGHT": "x"}, None)
    assert str(exc.value) == "CKPTD_MAX_INFLIGHT='x': expected an integer >= 1"
    assert isinstance(exc.value, ValueError)


def test_all_bad_settings_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config({"save_timeout_s": "-3"}, {**BASE_ENV, "CKPTD_MAX_INFLIGHT": "x", "CKPTD_LOG_LEVEL": "loud"}, None)
    lines = str(exc.value).splitlines()
    assert [line.split("=")[0] for line in lines] == ["CKPTD_MAX_INFLIGHT", "--save-timeout", "CKPTD_LOG_LEVEL"]


def test_an_overridden_bad_value_is_not_used() -> None:
    assert load_config({"max_inflight": "3"}, {**BASE_ENV, "CKPTD_MAX_INFLIGHT": "x"}, None).max_inflight == 3


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("max_inflights = 2\n", "unknown key 'max_inflights'; valid keys are root, socket, shm_dir, arena_policy"),
        ("[storage]\nroot = '/x'\n", "unknown key 'storage'"),
        ("[retention]\nkeep_worst = 3\n", "unknown key 'keep_worst' in [retention]; valid keys there are keep_last, keep_every, keep_best, best_mode"),
        ("retention = 3\n", "'retention' must be a table"),
        ("keep_last = 2\n[retention]\nkeep_last = 3\n", "keep_last is set both at the top level and in [retention]"),
        ('max_inflight = "2"\n', "max_inflight='2': expected an integer >= 1"),
        ("log_json = 1\n", "log_json=1: expected true or false"),
        ("[retention]\nkeep_every = -2\n", "retention.keep_every=-2: expected an integer >= 0"),
        ("root = 7\n", "root=7: expected a non-empty path"),
        ("max_inflight = \n", "is not valid TOML"),
    ],
)
def test_bad_files_name_the_file_and_key(tmp_path: Path, toml: str, message: str) -> None:
    path = write(tmp_path, toml)
    with pytest.raises(ConfigError) as exc:
        load_config({}, BASE_ENV, path)
    assert str(path) in str(exc.value)
    assert message in str(exc.value)


def test_unknown_key_lists_all_valid_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config({}, BASE_ENV, write(tmp_path, "colour = 'blue'\n"))
    assert all(name in str(exc.value) for name in FIELDS)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config({}, {**BASE_ENV, "CKPTD_CONFIG": str(tmp_path / "nope.toml")}, None)


def test_direct_construction_validates_and_normalizes() -> None:
    config = DaemonConfig(root="/r", socket="/s", log_level="INFO", save_timeout_s=5)  # type: ignore[arg-type]
    assert (config.root, config.log_level, config.save_timeout_s) == (Path("/r"), "info", 5.0)
    assert isinstance(config.save_timeout_s, float)
    with pytest.raises(ConfigError, match=r"DaemonConfig.max_inflight=0: expected an integer >= 1"):
        DaemonConfig(root=Path("/r"), socket=Path("/s"), max_inflight=0)


# issue 30 finding 5: the budget of shared memory, as a flag and resolved against the host's memory


def test_the_shm_budget_flag_takes_bytes_or_a_share_of_the_hosts_memory() -> None:
    config = config_from_args(parse_serve("--shm-budget", "25%", "--hold-while-saving", "--idle-release", "30"), BASE_ENV)
    assert (config.shm_budget, config.hold_while_saving, config.idle_release_s) == (ShmBudget(share=0.25), True, 30.0)
    assert config.shm_budget.resolve(8 * GiB) == 2 * GiB and str(config.shm_budget) == "25% of the host's memory"
    config = config_from_args(parse_serve("--shm-budget", "72MiB"), {**BASE_ENV, "CKPTD_SHM_BUDGET": "50%"})
    assert config.shm_budget.resolve(8 * GiB) == 72 << 20 and str(config.shm_budget) == "72 MiB"  # the flag wins
    assert load_config({}, BASE_ENV, None).shm_budget.resolve(8 * GiB) is None  # default: none (the directory's size)
    assert DaemonConfig(root=Path("/r"), socket=Path("/s"), shm_budget="10%").shm_budget == ShmBudget(share=0.1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"DaemonConfig.shm_budget='200%': expected .*'200%' is not a percentage"):
        DaemonConfig(root=Path("/r"), socket=Path("/s"), shm_budget="200%")  # type: ignore[arg-type]


def test_the_hosts_memory_is_at_most_memtotal() -> None:
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
    assert 0 < host_memory_bytes() <= total


# ------------------------------------------------------------------ the example file


def test_example_file_matches_the_defaults() -> None:
    assert load_config({}, BASE_ENV, EXAMPLE) == load_config({}, BASE_ENV, None)


def test_example_file_documents_every_setting() -> None:
    text = EXAMPLE.read_text()
    for name in FIELDS:
        assert re.search(rf"^#? ?{name} = ", text, re.MULTILINE), f"{name} is missing from {EXAMPLE.name}"


# ------------------------------------------------------------------ shared memory


def test_shm_check_passes_for_a_roomy_directory(tmp_path: Path) -> None:
    assert check_shm(tmp_path, 0) is None
    assert check_shm(tmp_path, 1) is None


def test_shm_check_reports_a_missing_directory(tmp_path: Path) -> None:
    message = check_shm(tmp_path / "missing", 0)
    assert message is not None and "does not exist" in message and "--shm-dir" in message


def test_shm_check_reports_too_little_space_with_the_container_fix(tmp_path: Path) -> None:
    message = check_shm(tmp_path, 1 << 60)
    assert message is not None
    assert str(tmp_path) in message and "free" in message
    assert "--shm-size" in message and "medium: Memory" in message


# ------------------------------------------------------------------ operations settings (issue 6)


def test_operations_settings_from_every_source(tmp_path: Path) -> None:
    path = write(tmp_path, '[retention]\nkeep_best = 2\nbest_mode = "max"\n')
    config = load_config({"metrics_port": "9477"}, {**BASE_ENV, "CKPTD_HEALTH_PORT": "9478", "CKPTD_METRICS_HOST": "127.0.0.1"}, path)
    assert (config.keep_best, config.best_mode, config.metrics_port, config.health_port, config.metrics_host) == (2, "max", 9477, 9478, "127.0.0.1")
    assert load_config({}, BASE_ENV, None).metrics_port == 0  # no endpoint unless asked


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"metrics_port": "70000"}, "--metrics-port='70000': expected a TCP port between 1 and 65535, or 0 (off)"),
        ({"metrics_port": "http"}, "--metrics-port='http': expected a TCP port"),
        ({"health_port": "-1"}, "--health-port='-1': expected a TCP port"),
        ({"metrics_host": "a b"}, "--metrics-host='a b': expected a host name or IP address"),
        ({"best_mode": "lower"}, "--best-mode='lower': expected one of 'min', 'max'"),
        ({"keep_best": "-2"}, "--keep-best='-2': expected an integer >= 0 (0 = off)"),
    ],
)
def test_bad_operations_settings_say_what_to_give(given: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(given, BASE_ENV, None)
    assert message in str(info.value)


def test_the_retention_policy_is_built_from_the_settings_in_one_place() -> None:
    from ckptd.daemon.config import DaemonConfig
    from ckptd.daemon.plan.retention import RetentionPolicy

    config = DaemonConfig(root=Path("/tmp/r"), socket=Path("/tmp/r.sock"), keep_last=2, keep_every=10, keep_best=1, best_mode="max")
    assert config.retention_policy() == RetentionPolicy(keep_last=2, keep_every=10, keep_best=1, best_mode="max")
