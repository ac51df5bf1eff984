"""containers' registries.conf: kiln reads the mirrors and insecure hosts podman and skopeo read.

The end-to-end tests use one file for both tools: a plain-HTTP docker-registry on 127.0.0.1 given
as Docker Hub's mirror (``insecure = true``); kiln and skopeo must resolve the same digest through
it, and an image ``build --push`` put there is read back by ``values`` with no option at all.
"""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from kiln.oci.endpoints import RegistryConfig
from tests.support.cli import one_line_error, run
from tests.support.registry import VLLM_VERSION

PIN = f"v{VLLM_VERSION}"


def _conf(tmp_path, text: str, monkeypatch):
    path = tmp_path / "containers-registries.conf"
    path.write_text(text)
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(path))
    monkeypatch.setenv("KILN_REGISTRIES", str(tmp_path / "kiln-registries.toml"))
    return path


def test_mirrors_and_insecure_hosts_read_unknown_keys_ignored(tmp_path, monkeypatch):
    _conf(tmp_path, """
unqualified-search-registries = ["docker.io"]
short-name-mode = "enforcing"
[[registry]]
prefix = "docker.io"
location = "docker.io"
blocked = false
[[registry.mirror]]
location = "mirror.example/dockerhub"   # a path: kiln keeps repository paths, so not usable
[[registry.mirror]]
location = "127.0.0.1:5999"
insecure = true
pull-from-mirror = "digest-only"
[[registry]]
location = "plain.example:5000"
insecure = true
[[registry]]
prefix = "quay.io"
location = "elsewhere.example"         # a rewrite moves pushes too: not followed
insecure = true
[[registry]]
prefix = "ghcr.io/someone"              # a repository prefix: not a whole registry
location = "ghcr.io/someone"
insecure = true
[registries.insecure]
registries = ["old.example:5000"]
[aliases]
"fedora" = "registry.fedoraproject.org/fedora"
""", monkeypatch)
    config = RegistryConfig.load()
    hub = config.endpoint("docker.io")
    assert (hub.host, hub.scheme) == ("127.0.0.1:5999", "http")
    assert config.endpoint("docker.io", push=True).host == "registry-1.docker.io"  # mirrors: pulls only
    assert config.endpoint("127.0.0.1:5999", push=True).scheme == "http"  # the host is plain HTTP for pushes too
    assert config.endpoint("plain.example:5000").scheme == "http"
    assert config.endpoint("old.example:5000").scheme == "http"
    assert config.endpoint("quay.io").host == "quay.io" and config.endpoint("quay.io").scheme == "https"
    assert config.endpoint("elsewhere.example").scheme == "https"
    assert config.endpoint("ghcr.io").scheme == "https"


def test_kiln_config_and_options_win(tmp_path, monkeypatch):
    _conf(tmp_path, '[[registry]]\nlocation = "docker.io"\n[[registry.mirror]]\nlocation = "a.example:1"\n', monkeypatch)
    (tmp_path / "kiln-registries.toml").write_text('[mirrors]\n"docker.io" = "b.example:2"\n')
    assert RegistryConfig.load().endpoint("docker.io").host == "b.example:2"
    assert RegistryConfig.load(["docker.io=http://c.example:3"]).endpoint("docker.io").host == "c.example:3"


def test_drop_ins_override_by_prefix(tmp_path, monkeypatch):
    from kiln.oci.containers_conf import read_registries_conf, registries_conf_files
    monkeypatch.delenv("CONTAINERS_REGISTRIES_CONF", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    system = tmp_path / "etc" / "registries.conf"
    (tmp_path / "etc" / "registries.conf.d").mkdir(parents=True)
    system.write_text('[[registry]]\nlocation = "docker.io"\n[[registry.mirror]]\nlocation = "a.example:1"\n')
    drop_in = tmp_path / "etc" / "registries.conf.d" / "50-mirror.conf"
    drop_in.write_text('[[registry]]\nlocation = "docker.io"\n[[registry.mirror]]\nlocation = "b.example:2"\n')
    (tmp_path / "etc" / "registries.conf.d" / "ignored.txt").write_text("not toml [")
    files = registries_conf_files(system)
    assert files == [system, drop_in]
    assert read_registries_conf(files).mirrors == {"docker.io": "b.example:2"}
    user = tmp_path / "xdg" / "containers" / "registries.conf"  # the user's file replaces the system's and its drop-ins
    user.parent.mkdir(parents=True)
    user.write_text("")
    assert registries_conf_files(system) == [user]


@pytest.mark.parametrize("text, field", [("[[registry]\n", None), ('[[registry]]\nlocation = "x"\ninsecure = "yes"\n',
                                                                       "registry[0].insecure")])
def test_unreadable_registries_conf_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys, text, field):
    path = _conf(tmp_path, text, monkeypatch)
    pins = tmp_path / "pins.toml"
    pins.write_text(f'[pins."{PIN}"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:{PIN}"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\n')
    before = pins.read_bytes()
    code, _, err = run(capsys, "--pins", pins, "pin", "lock")
    assert code == 2
    line = one_line_error(err)
    assert str(path) in line and (field is None or field in line), line
    assert pins.read_bytes() == before


@pytest.mark.registry
def test_kiln_and_skopeo_agree_through_one_registries_conf(tmp_path, monkeypatch, capsys, registry_plain):
    conf = _conf(tmp_path, f'[[registry]]\nprefix = "docker.io"\nlocation = "docker.io"\n'
                    f'[[registry.mirror]]\nlocation = "{registry_plain.host}"\ninsecure = true\n', monkeypatch)
    pins = tmp_path / "pins.toml"
    pins.write_text(f'[pins."{PIN}"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:{PIN}"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\n')
    code, _, err = run(capsys, "--pins", pins, "pin", "lock")  # no --mirror, no --insecure-registry
    assert code == 0, err
    # skopeo, reading the same file (skopeo 1.9 takes it as an option; podman honours the
    # environment variable), sees Docker Hub's name through the mirror
    raw = subprocess.run(["skopeo", "--registries-conf", str(conf), "inspect", "--raw",
                          f"docker://docker.io/vllm/vllm-openai:{PIN}"],
                         capture_output=True, check=True).stdout
    skopeo_digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    assert f'digest = "{skopeo_digest}"' in pins.read_text()
    assert skopeo_digest == registry_plain.digest_of(f"vllm/vllm-openai:{PIN}")


@pytest.mark.registry
def test_values_reaches_the_plain_http_registry_build_pushed_to(tmp_path, monkeypatch, capsys, registry_plain):
    from tests.publish.test_helm_values import IMAGE, Project
    _conf(tmp_path, f'[[registry]]\nlocation = "docker.io"\n'
                    f'[[registry.mirror]]\nlocation = "{registry_plain.host}"\ninsecure = true\n', monkeypatch)
    (tmp_path / "project").mkdir()
    project = Project(tmp_path / "project", registry_plain)
    common = ["--pins", project.pins, "--images", project.root / "images"]
    target = ["--image", IMAGE, "--pin", "v0.20.1", "--sm", "120",
              "--repository", f"{registry_plain.host}/{project.dest}"]
    code, out, err = run(capsys, *common, "build", *target, "--push", "--json")  # no registry option
    assert code == 0, err
    pushed = json.loads(out)["manifest_digest"]
    code, out, err = run(capsys, *common, "values", *target)  # no registry option either
    assert code == 0, err
    assert json.loads(out)["image"]["digest"] == pushed
