#!/usr/bin/python
"""Install a munge key (binary-safe, atomically, never echoed) or generate one where none exists."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: stepdeploy_munge_key
short_description: Install or generate a munge key without ever returning it
description:
  - With content_b64, makes the file at path hold exactly those bytes (written to a temporary file in the same
    directory and renamed into place), then sets owner, group and mode.
  - With generate and no content_b64, writes size random bytes when the file is missing or empty, and
    otherwise leaves the existing key alone.
  - The key is never part of the result. Supports check mode.
options:
  path:
    description: The key file.
    type: path
    required: true
  content_b64:
    description: The key, base64-encoded.
    type: str
  generate:
    description: Create a random key when the file is missing or empty (ignored when content_b64 is given).
    type: bool
    default: false
  size:
    description: Bytes of a generated key (munge's own default is 128).
    type: int
    default: 128
  owner:
    description: Owner of the file.
    type: str
    default: munge
  group:
    description: Group of the file.
    type: str
    default: munge
  mode:
    description: Mode of the file.
    type: raw
    default: "0400"
author: stepdeploy
"""

EXAMPLES = r"""
- name: Install the cluster's munge key
  stepdeploy_munge_key:
    path: /etc/munge/munge.key
    content_b64: "{{ key_b64 }}"
  no_log: true
"""

RETURN = r"""
path:
  description: The key file.
  returned: always
  type: str
generated:
  description: Whether a new random key was created.
  returned: always
  type: bool
"""

import base64  # noqa: E402 - Ansible modules start with their documentation strings
import binascii  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def _write(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".munge-key-", dir=os.path.dirname(path) or ".")
    try:
        os.fchmod(fd, 0o400)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "content_b64": {"type": "str", "no_log": True},
            "generate": {"type": "bool", "default": False},
            "size": {"type": "int", "default": 128},
            "owner": {"type": "str", "default": "munge"},
            "group": {"type": "str", "default": "munge"},
            "mode": {"type": "raw", "default": "0400"},
        },
        supports_check_mode=True,
    )
    path = module.params["path"]
    current = _read(path)
    wanted: bytes | None = None
    if module.params["content_b64"] is not None:
        try:
            wanted = base64.b64decode(module.params["content_b64"], validate=True)
        except (binascii.Error, ValueError):
            module.fail_json(msg="content_b64 is not valid base64")
        if len(wanted) < 32:
            module.fail_json(msg=f"a munge key needs at least 32 bytes, got {len(wanted)}")
    elif module.params["generate"] and not current:
        if module.params["size"] < 32:
            module.fail_json(msg="size must be at least 32 bytes")
        wanted = os.urandom(module.params["size"])
    generated = wanted is not None and module.params["content_b64"] is None
    changed = wanted is not None and wanted != current
    if changed and not module.check_mode:
        if not os.path.isdir(os.path.dirname(path)):
            module.fail_json(msg=f"{os.path.dirname(path)} does not exist (is munge installed?)")
        _write(path, wanted)
    if current is not None or (changed and not module.check_mode):
        file_args = module.load_file_common_arguments({"path": path, "owner": module.params["owner"],
                                                       "group": module.params["group"],
                                                       "mode": module.params["mode"]})
        changed = module.set_fs_attributes_if_different(file_args, changed)
    module.exit_json(changed=changed, path=path, generated=generated)


if __name__ == "__main__":
    main()
