"""Hardware catalog, lookup, overrides, what-ifs and host measurement."""
from __future__ import annotations

import pytest
import yaml

from shardserve.config import ConfigError
from shardserve.planner.hardware import (
    CATALOG_PATH, apply_what_if, get_hardware, load_catalog, measure_this_host,
)

REQUIRED = ["H100 SXM", "H200", "B200", "A100 80GB", "L40S", "MI300X", "TPU v5e", "TPU v5p", "Trainium2",
            "GB200", "H800", "RTX PRO 6000", "A100 40GB"]


def test_catalog_has_required_devices_with_sources():
    catalog = load_catalog()
    assert set(REQUIRED) <= set(catalog)
    for hw in catalog.values():
        assert hw.sources and all(s.strip() for s in hw.sources), hw.name
        assert hw.peak_flop_s["bfloat16"] > 0 and hw.memory_bytes > 0 and hw.memory_bandwidth_bytes_s > 0
        assert hw.price_per_hour_usd > 0 and hw.devices_per_node >= 1


def test_datasheet_figures_spot_check():
    h100 = get_hardware("H100 SXM")
    assert h100.peak_flop_s["bfloat16"] == pytest.approx(989.4e12)  # dense, not the 1979 sparse figure
    assert h100.memory_bandwidth_bytes_s == pytest.approx(3.35e12)
    assert get_hardware("A100 80GB").peak_flop_s_for("float16") == pytest.approx(312e12)
    with pytest.raises(ConfigError, match="float8"):
        get_hardware("A100 80GB").peak_flop_s_for("float8")


def test_blackwell_and_export_parts():
    gb200, h800 = get_hardware("gb200"), get_hardware("h800")
    # one NVLink domain of 72 GPUs, fp4 at twice fp8; the H800 is an H100 with a third less NVLink
    assert gb200.devices_per_node == 72 and gb200.peak_flop_s["float4"] == 2 * gb200.peak_flop_s["float8"]
    assert h800.peak_flop_s == get_hardware("h100").peak_flop_s
    assert h800.intra_node_bandwidth_bytes_s < get_hardware("h100").intra_node_bandwidth_bytes_s
    assert get_hardware("a100-40gb").memory_bytes == 40 * 2**30
    assert "float4" in get_hardware("rtx-pro-6000").peak_flop_s


def test_memory_is_what_the_device_has_in_binary_units():
    """The datasheets' "80 GB" of HBM is 80 GiB: 85.9e9 bytes, 5.9 GB more than 80e9 (a 70B
    fp8 model on one H100 has 40% more room for KV than decimal bytes give)."""
    assert get_hardware("h100").memory_bytes == 80 * 2**30
    assert get_hardware("h200").memory_bytes == 141 * 2**30
    assert get_hardware("mi300x").memory_bytes == 192 * 2**30


@pytest.mark.parametrize("alias,name", [("h100", "H100 SXM"), ("H100-sxm", "H100 SXM"), ("a100", "A100 80GB"),
                                        ("H100-SXM-80GB", "H100 SXM"), ("H200-SXM-141GB", "H200"),
                                        ("A100-SXM4-80GB", "A100 80GB"), ("A100-40GB", "A100 40GB"),
                                        ("GB200-NVL72", "GB200"), ("H800-SXM", "H800"),
                                        ("rtx-pro-6000-blackwell", "RTX PRO 6000"),
                                        ("tpu_v5e", "TPU v5e"), ("trn2", "Trainium2"), ("mi300x", "MI300X")])
def test_lookup_is_case_insensitive_with_aliases(alias, name):
    assert get_hardware(alias).name == name


def test_unknown_hardware_lists_known_names():
    with pytest.raises(ConfigError, match="unknown hardware 'h900'.*H100 SXM"):
        get_hardware("h900")


def _write_catalog(tmp_path, mutate):
    data = yaml.safe_load(CATALOG_PATH.read_text())
    mutate(data["devices"][0])
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_missing_field_names_device_and_field(tmp_path):
    path = _write_catalog(tmp_path, lambda d: d.pop("memory_bandwidth_bytes_s"))
    with pytest.raises(ConfigError, match="'H100 SXM' is missing field 'memory_bandwidth_bytes_s'"):
        load_catalog(path)


def test_bad_values_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="'H100 SXM' field 'memory_bytes' must be positive"):
        load_catalog(_write_catalog(tmp_path, lambda d: d.update(memory_bytes=0)))
    with pytest.raises(ConfigError, match="'sources'"):
        load_catalog(_write_catalog(tmp_path, lambda d: d.update(sources=[])))
    (tmp_path / "junk.yaml").write_text("devices: {oops: 1}\n")
    with pytest.raises(ConfigError, match="'devices:' list"):
        load_catalog(tmp_path / "junk.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_catalog(tmp_path / "absent.yaml")


def test_what_if_scales_fields():
    h100 = get_hardware("h100")
    hw = apply_what_if(h100, "mem_bw=2x, flops=1.5x,memory=1.5x,price=0.8x")
    assert hw.memory_bandwidth_bytes_s == pytest.approx(2 * 3.35e12)
    assert hw.peak_flop_s["bfloat16"] == pytest.approx(1.5 * 989.4e12)
    assert hw.peak_flop_s["float8"] == pytest.approx(1.5 * 1978.9e12)
    assert hw.memory_bytes == 120 * 2**30 and isinstance(hw.memory_bytes, int)
    assert hw.price_per_hour_usd == pytest.approx(0.8 * 4.0)
    assert "what-if" in hw.name
    assert apply_what_if(h100, "") is h100


@pytest.mark.parametrize("spec,match", [("bandwidth=2x", "bad what-if term"), ("mem_bw", "bad what-if term"),
                                        ("mem_bw=fast", "not a factor"), ("price=-1x", "positive")])
def test_what_if_rejects_bad_terms(spec, match):
    with pytest.raises(ConfigError, match=match):
        apply_what_if(get_hardware("h100"), spec)


def test_measure_this_host_returns_positive_figures():
    # small sizes: only the figures' presence is checked, and on a host without AVX-512 a bf16
    # matmul takes torch's slow path (84 s for one 2048^3 product on an AVX2-only EPYC)
    hw = measure_this_host(device="cpu", matmul_size=256, num_copy_bytes=16 * 2**20)
    assert hw.name == "this host"
    assert hw.peak_flop_s["bfloat16"] > 1e8 and hw.memory_bandwidth_bytes_s > 1e8 and hw.memory_bytes > 0
    assert hw.intra_node_bandwidth_bytes_s == 0 and hw.price_per_hour_usd == 0
