"""Plan devices are matched to local CUDA devices by the UUID or PCI bus id `flashflex profile` recorded
(hardware/gpu_identity.py), not by ordinal; fake device properties stand in for GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashflex_cli.errors import InputError
from flashflex_cli.hardware import gpu_identity
from flashflex_cli.hardware.cluster import Cluster, load_cluster
from flashflex_cli.hardware.gpu_identity import LocalGpu, cuda_ordinal, normal_bus_id, visible_gpus
from flashflex_cli.hardware.probe_local import DeviceProbe, NodeProbe, node_from_probe

A = "6a2c5f4e-1b2c-4d3e-8f90-0123456789ab"
B = "0f1e2d3c-4b5a-6978-8a9b-cdef01234567"
GIB = 1024**3


def test_a_permuted_visible_list_is_followed_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")  # the driver's device 1 is ordinal 0 here
    visible = [LocalGpu(0, B, "0000:3b:00"), LocalGpu(1, A, "0000:86:00")]
    assert cuda_ordinal("n/0", f"GPU-{A.upper()}", None, 0, visible) == 1  # nvidia-smi's spelling accepted
    assert cuda_ordinal("n/1", B, None, 1, visible) == 0


def test_the_bus_id_stands_in_where_no_uuid_is_recorded() -> None:
    visible = [LocalGpu(0, None, "0000:3b:00"), LocalGpu(1, None, "0000:86:00")]
    assert normal_bus_id("00000000:86:00.0") == "0000:86:00"  # nvidia-smi's form
    assert cuda_ordinal("n/0", None, "00000000:86:00.0", 0, visible) == 1
    assert cuda_ordinal("n/0", A, "0000:3B:00", 0, visible) == 0  # no visible UUID to compare: the bus id


def test_without_a_recorded_identity_the_index_is_the_ordinal() -> None:
    visible = [LocalGpu(0, A), LocalGpu(1, B)]
    assert cuda_ordinal("n/1", None, None, 1, visible) == 1
    with pytest.raises(InputError, match=r"^n/2 \(cuda:2\) is not visible here: .*2 visible"):
        cuda_ordinal("n/2", None, None, 2, visible)


def test_a_missing_device_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(InputError) as exc:
        cuda_ordinal("gpu0/1", B, None, 1, [LocalGpu(0, A)])
    text = str(exc.value)
    assert "\n" not in text
    assert text == (f"gpu0/1 is GPU-{B} in the cluster file, and no visible CUDA device is: "
                    f"CUDA_VISIBLE_DEVICES='0', 1 visible (cuda:0 GPU-{A})")


def test_visible_gpus_reads_what_torch_exposes(monkeypatch: pytest.MonkeyPatch) -> None:
    props = [SimpleNamespace(uuid=A, pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0),
             SimpleNamespace(uuid=f"GPU-{B}")]  # an older torch: no PCI numbers
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    assert visible_gpus() == [LocalGpu(0, A, "0000:3b:00"), LocalGpu(1, B, None)]
    assert gpu_identity.pci_bus_id(1, 0x86, 2) == "0001:86:02"


def test_profile_records_the_identity_and_old_cluster_files_keep_loading(tmp_path: Path) -> None:
    probe = NodeProbe("gpuhost", "cuda", [DeviceProbe(0, "NVIDIA A100-SXM4-80GB", "bf16", 2.5e14, 80 * GIB, 1.7e12,
                                                      None, A, "0000:3b:00")])
    device = node_from_probe(probe).devices[0]
    assert (device.uuid, device.pci_bus_id) == (A, "0000:3b:00")
    old = load_cluster(Path(__file__).parent / "golden" / "cluster-2node.json")  # written before the fields
    assert all(d.uuid is None and d.pci_bus_id is None for n in old.nodes for d in n.devices)
    data = json.loads(old.to_json())
    assert "uuid" not in json.dumps(data)  # unset fields stay out of the file: its sha256 is unchanged
    data["nodes"][0]["devices"][0]["uuid"] = "not-a-uuid"
    with pytest.raises(ValueError, match="uuid"):
        Cluster.model_validate(data)
