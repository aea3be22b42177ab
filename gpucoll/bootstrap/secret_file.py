"""The per-user rendezvous secret, for launchers that hand their ranks none (mpirun, srun, a plain script).

torchrun's ranks meet in its agent's store, ``gpucoll.spawn`` and ``init(mpi_comm=...)`` make a secret and pass it
on; under mpirun or srun nothing private reaches every rank except the user's own files. So, as ssh keys and munge
do, the secret lives in a file that only this user can read: ``~/.gpucoll/store_secret`` (0600, in a 0700
directory), made by whichever rank first needs it. Ranks on other nodes read the same file where home directories
are shared (the usual cluster set-up); where they are not, each node makes its own, the store refuses the other
nodes' ranks, and their error says to set ``GPUCOLL_STORE_SECRET``. The store then admits this user's processes,
not only this job's: ``GPUCOLL_STORE_SECRET`` set per job keeps even those out.

Creation is race-free without locks: each rank that finds no file writes a private temporary file and links it to
the name, which succeeds for exactly one of them; every rank then reads the winner's file, so no rank ever reads
a half-written secret or keeps one that lost.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from gpucoll.bootstrap import _wire as w
from gpucoll.bootstrap.store import HOW_TO_SET_SECRET
from gpucoll.errors import InvalidArgument

__all__ = ["default_path", "read_or_create", "refused_note"]

def default_path() -> Path:
    return Path.home() / ".gpucoll" / "store_secret"


def _create(path: Path, new_secret: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".store_secret.")  # mkstemp makes it 0600
    try:
        os.write(fd, (new_secret + "\n").encode("ascii"))
        os.fsync(fd)
        os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another rank won the race: its secret is the one
    finally:
        os.unlink(tmp)


def read_or_create(new_secret: str, path: Path | None = None) -> str:
    """The secret in `path` (default ``~/.gpucoll/store_secret``), made from `new_secret` if the file does not
    exist. InvalidArgument, saying how to set GPUCOLL_STORE_SECRET instead, when the file cannot be made or read,
    belongs to another user, or other users can read it (a secret they can read admits them)."""
    path = default_path() if path is None else Path(path)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            _create(path, new_secret)
        st = path.stat()
        if st.st_uid != os.getuid():
            raise InvalidArgument(f"the per-user rendezvous secret {path} belongs to uid {st.st_uid}, not to this "
                                  f"user (uid {os.getuid()}): remove it, or {HOW_TO_SET_SECRET}")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InvalidArgument(f"the per-user rendezvous secret {path} is open to other users (mode "
                                  f"{stat.S_IMODE(st.st_mode):03o}), who could then join this user's jobs: "
                                  f"chmod 600 {path}, or {HOW_TO_SET_SECRET}")
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError, RuntimeError) as e:  # RuntimeError: Path.home() without a home directory
        raise InvalidArgument(f"no job secret: GPUCOLL_STORE_SECRET is not set and the per-user secret file "
                              f"{path} cannot be used ({e}); {HOW_TO_SET_SECRET}") from None
    if len(text) < w.MIN_SECRET_BYTES:
        raise InvalidArgument(f"the per-user rendezvous secret {path} holds {len(text)} characters; a secret needs "
                              f"at least {w.MIN_SECRET_BYTES}: remove the file (a new one is made), or "
                              f"{HOW_TO_SET_SECRET}")
    return text


def refused_note(path: Path | None = None) -> str:
    """What to add to the store's refusal when this rank's secret came from the per-user file."""
    path = default_path() if path is None else Path(path)
    return (f"; this rank's secret came from the per-user file {path} (GPUCOLL_STORE_SECRET is not set): ranks on "
            f"nodes that do not share that home directory hold different ones, so {HOW_TO_SET_SECRET}")
