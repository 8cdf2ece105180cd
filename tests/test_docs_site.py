"""The docs site (mkdocs.yml, scripts/mkdocs_hooks.py): `mkdocs build --strict` is green, and what makes it
fail names the page or key: a broken link, a page left out of the nav, a config key base.yaml does not
document, a README link the site cannot serve."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mkdocs.exceptions import PluginError

ROOT = Path(__file__).parents[1]
BASE_YAML = ROOT / "boost_jax" / "configs" / "base.yaml"


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


hooks = _hooks()


def _build(config: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    """The whole site, as CI builds it: every page, the generated config reference and API reference."""
    out = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stderr[-4000:]
    config_page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "train.muon.ns_coeffs" in config_page and "model.attn_latent_heads" in config_page
    assert "build_model" in (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "Quickstart" in (tmp_path / "site" / "index.html").read_text()  # the front page is README.md


def _small_site(tmp_path: Path, pages: dict[str, str], nav: list[str]) -> Path:
    """A site with mkdocs.yml's theme and validation settings, and the given pages (no hooks, no API)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config.update(docs_dir=str(tmp_path / "docs"), nav=nav, plugins=["search"])
    config.pop("hooks")
    config.pop("exclude_docs")
    for name, text in pages.items():
        (tmp_path / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / name).write_text(text)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return tmp_path / "mkdocs.yml"


def test_a_broken_link_or_a_page_left_out_of_the_nav_fails_the_build_naming_it(tmp_path):
    config = _small_site(tmp_path, {"index.md": "# Home\n\nSee [the guide](guides/gone.md) and [a part](#nowhere).\n",
                                    "guides/forgotten.md": "# Forgotten\n"}, ["index.md"])
    out = _build(config, tmp_path / "site")
    assert out.returncode == 1
    assert "'index.md' contains a link 'guides/gone.md'" in out.stderr, out.stderr
    assert "#nowhere" in out.stderr and "guides/forgotten.md" in out.stderr, out.stderr


def test_a_config_key_base_yaml_does_not_document_stops_the_build_naming_it():
    text = BASE_YAML.read_text()
    page = hooks.config_reference(text)
    assert "| `train.z_loss` | `0.0` |" in page and "| `train.muon.*` |" in page
    without = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("z_loss:"))
    with pytest.raises(PluginError, match=r"documents no train\.z_loss \("):
        hooks.config_reference(without)


def test_every_key_of_the_typed_config_is_in_the_reference():
    documented = {row.key for row in hooks.parse(BASE_YAML.read_text()) if isinstance(row, hooks.Row)}
    assert [k for k in hooks.config_keys() if k not in documented] == []
    assert "parallel.heartbeat_timeout_s" in hooks.config_keys()  # the typed config's keys, not base.yaml's own


def test_the_front_page_is_the_readme_with_its_links_into_docs():
    page = hooks.readme_page("[a](docs/guides/data.md#mixtures) [b](boost_jax/configs/base.yaml) [c](https://x.org)")
    assert page == "[a](guides/data.md#mixtures) [b](reference/config.md) [c](https://x.org)"
    with pytest.raises(PluginError, match="README.md links to 'tests/conftest.py', outside docs/"):
        hooks.readme_page("[conftest](tests/conftest.py)")


def test_the_reference_reads_every_line_of_base_yaml_or_names_it():
    with pytest.raises(PluginError, match="cannot read '- not a key'"):
        hooks.parse("model:\n  arch: cola\n- not a key\n")
