"""The fleet ledger in the store and `deltafs status`."""

from __future__ import annotations

import datetime as dt
import json

import pytest
import typer
from deltafs.cli.watch import register
from typer.testing import CliRunner

from deltafs.errors import UsageError
from deltafs.store.open import open_objects
from deltafs.store.repo import Repository
from deltafs.watch.ledger import (
    HostStatus,
    check_host_id,
    fleet_report,
    ledger_key,
    write_status,
)


def cli():
    app = typer.Typer()
    register(app)
    return app


def status_cli(*args: str):
    result = CliRunner().invoke(cli(), ["status", *args], standalone_mode=False)
    if result.exception:
        raise result.exception
    return result


def host(store_id: str, name: str, served: int | None, **kw) -> HostStatus:
    return HostStatus(host_id=name, dest=f"/models/{name}", engine="sglang", engine_url="http://127.0.0.1:30000",
                      store_id=store_id, state=kw.pop("state", "serving"), served_version=served, **kw)


@pytest.fixture()
def fleet(trainer):
    for _ in range(3):
        trainer.push()
    repo = Repository.open(trainer.store)
    write_status(repo.objects, host(repo.store_id, "rollout-a", 3,
                                    last_sync={"version": 3, "pause_s": 0.12, "sync_s": 1.5, "at": "x", "fallback": False}))
    write_status(repo.objects, host(repo.store_id, "rollout-b", 1, failures=3, state="degraded",
                                    last_error="SwitchError: switch to version 3 failed: HTTP 500"))
    return repo


def test_report_shows_lag_and_failures(fleet):
    report = fleet_report(fleet)
    assert report.head == 3 and not report.healthy
    rows = {r.status.host_id: r for r in report.hosts}
    assert rows["rollout-a"].lag == 0 and rows["rollout-a"].problem is None
    assert rows["rollout-b"].lag == 2 and "3 failed sync(s)" in rows["rollout-b"].problem


def test_silent_host_is_stale(fleet):
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=10)
    rows = {r.status.host_id: r for r in fleet_report(fleet, stale_after=300, now=later).hosts}
    assert rows["rollout-a"].stale and "no report since" in rows["rollout-a"].problem


def test_unreadable_entry_is_reported_not_fatal(fleet):
    fleet.objects.put("fleet/garbage.json", b"{not json")
    rows = fleet_report(fleet).hosts
    assert any(r.status is None and "unreadable" in r.problem for r in rows)


def test_status_cli_human_and_exit_code(fleet):
    result = status_cli(fleet.url)
    assert result.return_value == 1  # rollout-b has failures
    lines = result.stdout.splitlines()
    assert "HEAD is version 3" in lines[0]
    row_a = next(line for line in lines if line.startswith("rollout-a"))
    row_b = next(line for line in lines if line.startswith("rollout-b"))
    assert "serving" in row_a and "v3 pause 0.12s / 1.50s" in row_a
    assert "degraded" in row_b and "HTTP 500" in row_b


def test_status_cli_json(fleet):
    result = status_cli(fleet.url, "--json")
    data = json.loads(result.stdout)
    assert data["head"] == 3 and data["healthy"] is False
    assert {h["host"]["host_id"]: h["lag"] for h in data["hosts"]} == {"rollout-a": 0, "rollout-b": 2}


def test_status_says_when_the_head_object_lags(fleet):
    # A push that committed version 3 but could not move HEAD (it died, or the disk was full): readers and status
    # call 3 the newest, and status says that the HEAD object still names 2.
    from deltafs.format.keys import HEAD_KEY
    from deltafs.format.records import Head

    assert json.loads(status_cli(fleet.url, "--json").stdout)["head_object"] == 3
    assert "HEAD object" not in status_cli(fleet.url).stdout
    fleet.objects.put(HEAD_KEY, Head(2, fleet.manifest(2).digest).to_bytes())
    data = json.loads(status_cli(fleet.url, "--json").stdout)
    assert (data["head"], data["head_object"]) == (3, 2)
    first = status_cli(fleet.url).stdout.splitlines()[0]
    assert "HEAD is version 3 (the HEAD object still names version 2" in first
    fleet.objects.delete(HEAD_KEY)
    assert "HEAD is version 3 (the HEAD object is missing" in status_cli(fleet.url).stdout.splitlines()[0]
    assert json.loads(status_cli(fleet.url, "--json").stdout)["head_object"] is None


def test_status_flags_a_head_naming_a_missing_version(fleet):
    """pull exits 4 on such a HEAD; status said "HEAD is version 99" and exit 0."""
    from deltafs.format.keys import HEAD_KEY
    from deltafs.format.records import Head

    fleet.objects.delete(ledger_key("rollout-b"))
    assert status_cli(fleet.url).return_value == 0
    fleet.objects.put(HEAD_KEY, Head(99, fleet.manifest(3).digest).to_bytes())
    result = status_cli(fleet.url)
    assert result.return_value == 1
    assert "names version 99, which is not in the store" in result.stdout and "problem: HEAD of " in result.stdout
    data = json.loads(status_cli(fleet.url, "--json").stdout)
    assert data["healthy"] is False and "version 99" in data["head_problem"]


def test_status_cli_healthy_fleet_exits_zero(fleet):
    fleet.objects.delete(ledger_key("rollout-b"))
    assert status_cli(fleet.url).return_value == 0


def test_status_of_a_store_nobody_watches(trainer):
    trainer.push()
    result = status_cli(trainer.store)
    assert result.return_value == 0 and "no watcher has reported yet" in result.stdout


def test_ledger_round_trip_and_unknown_fields_ignored(trainer):
    trainer.push()
    objects = open_objects(trainer.store)
    st = host("abc", "h1", 1)
    write_status(objects, st)
    raw = json.loads(objects.get("fleet/h1.json"))
    raw["added_by_a_newer_deltafs"] = 1
    assert HostStatus.from_bytes(json.dumps(raw).encode()).served_version == 1


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "-lead", "x" * 200])
def test_host_id_must_be_a_safe_key(bad):
    with pytest.raises(UsageError):
        check_host_id(bad)


def test_ledger_write_failure_is_not_raised(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    objects = open_objects(str(blocker))  # a store "directory" that is a file: every put fails
    assert write_status(objects, host("abc", "h1", 1)) is False


def test_prune_after_removes_retired_hosts_only(fleet):
    old = host(fleet.store_id, "retired", 1)
    write_status(fleet.objects, old)
    raw = json.loads(fleet.objects.get(ledger_key("retired")))
    raw["updated_at"] = "2020-01-01T00:00:00Z"
    fleet.objects.put(ledger_key("retired"), json.dumps(raw).encode())
    result = status_cli(fleet.url, "--prune-after", "86400", "--json")
    assert {h["host"]["host_id"] for h in json.loads(result.stdout)["hosts"]} == {"rollout-a", "rollout-b"}
    assert not fleet.objects.exists(ledger_key("retired"))
    with pytest.raises(UsageError):
        status_cli(fleet.url, "--prune-after", "0")


def test_problem_texts_are_short(tmp_path):
    from deltafs.errors import short_problem

    raw = ("HTTPConnectionPool(host='127.0.0.1', port=30000): Max retries exceeded with url: /model_info (Caused by "
           "NewConnectionError('<urllib3.connection.HTTPConnection object at 0x7f00>: Failed to establish a new "
           "connection: [Errno 111] Connection refused'))")
    assert short_problem(ConnectionError(raw)) == "cannot reach 127.0.0.1:30000 (connection refused)"
    assert len(short_problem(RuntimeError("x" * 1000))) <= 160


def test_our_words_stay_in_front_of_a_shortened_connection_error():
    from deltafs.errors import EngineError, short_problem

    raw = ("cannot reach SGLang at http://127.0.0.1:30000: HTTPConnectionPool(host='127.0.0.1', port=30000): Max "
           "retries exceeded with url: /model_info (Caused by NewConnectionError('x: Failed to establish a new "
           "connection: [Errno 111] Connection refused'))")
    assert short_problem(EngineError(raw)) == "cannot reach SGLang at http://127.0.0.1:30000: connection refused"


@pytest.mark.parametrize("field", [
    '"served_version":"5"', '"staged_version":true', '"checksums":[]', '"needs_restart":"yes"', '"store_id":5',
    '"host_id":5', '"last_sync":"x"', '"last_sync":{"version":"x","pause_s":"y","sync_s":1}',
    '"needs_restart":{"version":[1]}', '"engine_hosts":"2"',
])
def test_a_record_of_the_wrong_types_is_an_unreadable_entry_not_a_crash(fleet, field):
    """Anyone with write access to the store can write fleet/; a wrong type crashed status ("internal error") and
    the group watchers that compare versions (adversarial pass)."""
    fleet.objects.put("fleet/h2.json", ('{"format":"deltafs.fleet","format_version":1,"host_id":"h2","dest":"/d",'
                                        '"engine":"sglang","state":"serving",' + field + "}").encode())
    result = status_cli(fleet.url)
    assert result.return_value == 1 and "fleet/h2.json" in result.stdout and "unreadable ledger entry" in result.stdout
    assert json.loads(status_cli(fleet.url, "--json").stdout)["healthy"] is False


def test_a_host_whose_clock_runs_ahead_is_not_taken_for_alive(fleet):
    """A host whose clock ran an hour ahead was SIGKILLed: `status --stale-after 5` never flagged it ("-3591s
    ago") and an engine group counted it live (adversarial pass). A record dated more than a minute in the future
    is a problem in status, and no sign of life for a group."""
    from deltafs.watch.group import ready_hosts

    earlier = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)  # this host's clock, an hour behind theirs
    rows = {r.status.host_id: r for r in fleet_report(fleet, stale_after=5, now=earlier).hosts}
    assert rows["rollout-a"].stale and "in the future" in rows["rollout-a"].problem
    assert not fleet_report(fleet, now=earlier).healthy
    assert fleet_report(fleet, now=dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=30)).hosts[0].problem is None
    write_status(fleet.objects, host(fleet.store_id, "node-1", 3, engine_group="g", engine_hosts=2, held=[3]))
    assert ready_hosts(fleet.objects, "g", 3, store_id=fleet.store_id)[0] == {"node-1"}
    assert ready_hosts(fleet.objects, "g", 3, store_id=fleet.store_id, now=earlier)[0] == set()
