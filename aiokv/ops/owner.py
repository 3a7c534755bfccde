# SPDX-License-Identifier: Apache-2.0
"""The commands that write to a cache directory (`aiokv clear`, `pin`, `unpin`: orders.py) act as its owner.

The engines run as the directory's owner (meta.py refuses any other user), so every file such a
command creates or rewrites there (DIR/control; a stopped engine's journal and checkpoint) must
be that user's, or the engines cannot read it (issue 40: `sudo aiokv clear` left DIR/control
root's, mode 0600; the engines stopped following each other and failed at their next start).
Run as root, the command takes the owner's user and group ids for its work, and first gives back
a control file an earlier run as root left root's; run as any other user, it refuses in one line
(the caller's error type: errors.py).

Threading: one thread (the CLI's); the effective ids are the whole process's.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import sys

from aiokv.data import format as fmt
from aiokv.data.dirs import DIR_FLAGS
from aiokv.ops.errors import OpsError


def _who(uid: int) -> tuple[str, str]:
    """(how a user is named in a message, how sudo -u names it)."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}", f"'#{uid}'"
    return f"user {name} (uid {uid})", name


@contextlib.contextmanager
def as_owner(root: str, error: type[OpsError] = OpsError):
    """The block runs with the effective ids of the directory's owner (see above); error: the
    type raised when the command may not act as that user."""
    st = os.stat(root)
    uid, euid = st.st_uid, os.geteuid()
    if uid == euid:
        yield
        return
    owner, sudo = _who(uid)
    if euid != 0:
        raise error(
            f"aiokv: {root} belongs to {owner}, the user its engines run as, not to {_who(euid)[0]}; "
            f"run the command as that user: sudo -u {sudo} aiokv ..."
        )
    _give_back_control(root, uid, st.st_gid)
    groups, egid = os.getgroups(), os.getegid()
    os.setgroups([])
    os.setegid(st.st_gid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(egid)
        os.setgroups(groups)


def _give_back_control(root: str, uid: int, gid: int) -> None:
    """(As root.) DIR/control made the owner's if it is not (never through a symlink)."""
    fd = os.open(root, DIR_FLAGS)
    try:
        try:
            st = os.stat(fmt.CONTROL_NAME, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode) and st.st_uid != uid:
            os.chown(fmt.CONTROL_NAME, uid, gid, dir_fd=fd, follow_symlinks=False)
            print(
                f"aiokv: {os.path.join(root, fmt.CONTROL_NAME)} was uid {st.st_uid}'s (an earlier run as root): "
                f"given back to {_who(uid)[0]}, whom its engines run as",
                file=sys.stderr,
            )
    finally:
        os.close(fd)
