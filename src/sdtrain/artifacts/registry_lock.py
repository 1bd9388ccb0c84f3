"""The one-run-at-a-time lock of a model registry: ``retrain.lock`` under its root."""

from __future__ import annotations

import datetime
import json
import threading
import uuid
from typing import Any

from sdtrain.artifacts.conditional_writes import ConditionalStore, RegistryConflict, _now, _whoami
from sdtrain.errors import SdtrainError
from sdtrain.logs import log

LOCK_FILE = "retrain.lock"
# A holder renews its lease every quarter of it: a holder that died (SIGKILL, lost node) blocks
# later runs for at most this long, and a live one survives three missed renewals.
LOCK_LEASE_S = 900.0


class RegistryBusy(SdtrainError):
    """Another retrain run holds the registry's lock (or is taking it over): this run did nothing."""


class RegistryLock:
    """The one-run-at-a-time lock of a registry: ``retrain.lock`` under its root, holding the owner
    (host, pid, run, date, job), when it was taken and when its lease expires.

    Taken by an exclusive create. A live lock (lease not expired) refuses the next run with
    RegistryBusy, naming the file, the owner and the expiry; a stale one (its holder died without
    releasing it) is taken over by a conditional replace of exactly the stale content, so of two
    runs that find it stale, one wins; a lock of an earlier attempt of the same job counts as stale.
    The holder renews the lease from a thread every quarter of it, and releases the lock on exit (a
    conditional delete: never someone else's lock).
    """

    def __init__(self, registry: ConditionalStore, owner: dict[str, Any], lease_s: float, clock=None):
        self.registry, self.owner, self.lease_s = registry, owner, lease_s
        self.clock = clock or _now
        self.path = registry._path(LOCK_FILE)
        self.uri = registry._uri(self.path)
        self.token = uuid.uuid4().hex
        self._tag: str | None = None
        self._expires: datetime.datetime | None = None
        self._lost: str | None = None
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> RegistryLock:
        self.acquire()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            self.release()
        except Exception as e:
            if error is None:
                raise
            # The run's own error is what the operator needs; the lease ends the lock anyway.
            log.warning(f"could not release {self.uri} ({e}); it expires with its lease")

    def acquire(self) -> None:
        registry = self.registry
        text = self._text(self.clock())
        if (tag := registry._create(self.path, text)) is not None:
            self._held(text, tag)
            return
        current, tag = registry._read_tagged(self.path)
        if current is None:  # released between the two calls: one more try, as a fresh contender
            if (tag := registry._create(self.path, text)) is not None:
                self._held(text, tag)
                return
            current, tag = registry._read_tagged(self.path)
        holder = _parse_lock(current or "")
        expires = holder.get("expires_at")
        if expires is None:
            raise RegistryBusy(
                f"{self.uri} exists but is not a lock sdtrain wrote ({(current or '')[:120]!r}); "
                "if no retrain run is going on, delete it"
            )
        same_job = holder.get("job") is not None and holder.get("job") == self.owner.get("job")
        # Anyscale starts a job's retry only once its previous attempt has ended: a lock held by an
        # earlier attempt of this job is stale whatever its lease says, and waiting would only
        # spend this attempt (and the next) on the refusal.
        if expires > self.clock() and not same_job:
            raise RegistryBusy(
                f"{self.uri} is held by {_describe(holder)} until {expires.isoformat(timespec='seconds')} (its lease, "
                "renewed while it runs): another retrain run is going on, so this one did nothing. If that run is "
                "dead, wait for the lease to expire, or delete the file"
            )
        text = self._text(self.clock())
        assert tag is not None  # the lock was read (current is not None), so it has a tag
        new_tag = registry._replace(self.path, text, tag)
        if new_tag is None:
            raise RegistryBusy(
                f"{self.uri} was stale (held by {_describe(holder)}, lease until "
                f"{expires.isoformat(timespec='seconds')}) and another run took it over first; this one did nothing"
            )
        why = (
            "an earlier attempt of this job, which ended without releasing it"
            if same_job
            else f"let its lease expire at {expires.isoformat(timespec='seconds')} without releasing it"
        )
        log.info(f"took over {self.uri}: its holder ({_describe(holder)}) {why}")
        self._held(text, new_tag)

    def renew(self) -> None:
        """Extend the lease; a lock that was taken over meanwhile is marked lost (ensure_held raises)."""
        with self._guard:
            if self._tag is None or self._lost:
                return
            text = self._text(self.clock())
            tag = self.registry._replace(self.path, text, self._tag)
            if tag is not None:
                self._remember(text, tag)
            else:
                self._lost = f"{self.uri} is no longer this run's: it was taken over or removed while held"

    def ensure_held(self) -> None:
        """Raise RegistryConflict unless this run still holds the lock (checked before each registry write)."""
        with self._guard:
            if self._lost is None and self._expires is not None and self.clock() >= self._expires:
                self._lost = f"this run's lease on {self.uri} expired at {self._expires.isoformat()} without renewal"
            if self._lost:
                raise RegistryConflict(f"{self._lost}; nothing more is written to the registry by this run")

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with self._guard:
            if self._tag is not None and not self._lost and not self.registry._delete(self.path, self._tag):
                log.warning(f"{self.uri} was no longer this run's when it ended; left as it is")
            self._tag = None

    def _held(self, text: str, tag: str) -> None:
        self._remember(text, tag)
        self._renewer = threading.Thread(target=self._renew_until_released, name="sdtrain-registry-lock", daemon=True)
        self._renewer.start()

    def _renew_until_released(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                self.renew()
            except Exception as e:  # storage trouble: the next renewal may get through, within the lease
                log.warning(f"could not renew {self.uri} ({e}); trying again")

    def _remember(self, text: str, tag: str) -> None:
        self._tag = tag
        self._expires = _parse_lock(text)["expires_at"]

    def _text(self, now: datetime.datetime) -> str:
        expires = now + datetime.timedelta(seconds=self.lease_s)
        return json.dumps(
            {
                **_whoami(),
                **self.owner,
                "token": self.token,
                "taken_at": now.isoformat(),
                "expires_at": expires.isoformat(),
            }
        )


def _parse_lock(text: str) -> dict[str, Any]:
    try:
        holder = json.loads(text)
        holder["expires_at"] = datetime.datetime.fromisoformat(holder["expires_at"])
        return holder
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return {}


def _describe(holder: dict[str, Any]) -> str:
    keys = ("run", "date", "job", "host", "pid", "taken_at")
    return ", ".join(f"{k} {holder[k]}" for k in keys if holder.get(k) is not None)
