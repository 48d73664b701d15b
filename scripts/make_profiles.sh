#!/usr/bin/env bash
# Regenerate every bundled cluster profile in profiles/ from the device catalog (`make profiles`).
# One line per profile: `profile NAME 'SPEC' 'DESCRIPTION'`; tests/test_profile_cli.py reads these lines
# and checks that the committed files equal what the command writes, byte for byte.
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHFLEX=${FLASHFLEX:-.venv/bin/flashflex}

profile() {  # profile NAME SPEC DESCRIPTION
  "$FLASHFLEX" profile --synthetic "$2" --name "$1" --description "$3" --out "profiles/$1.json" 2>/dev/null
  echo "profiles/$1.json"
}

profile paper-hetero-1 '1x8xRTX-3080Ti:nic=eth:bw=10,1x8xRTX-3090:nic=eth:bw=10,3x8xRTX-4090:nic=eth:bw=10' 'FlashFlex (arXiv 2409.01143) heterogeneous cluster 1: 8x 3080 Ti + 8x 3090 + 24x 4090 on PCIe nodes joined by TCP over 10 Gbit/s Ethernet (NIC speed assumed)'
profile paper-hetero-2 '1x8xRTX-3080Ti:nic=eth:bw=10,1x8xRTX-3090:nic=eth:bw=10,1x8xRTX-4090:nic=eth:bw=10,1x8xA100-80G-SXM:nic=eth:bw=10' 'FlashFlex (arXiv 2409.01143) heterogeneous cluster 2: 8x 3080 Ti + 8x 3090 + 8x 4090 + 8x A100-80G with NVLink inside its node; nodes joined by TCP over 10 Gbit/s Ethernet (NIC speed assumed)'
profile paper-hetero-3 '1x8xRTX-3090:nic=eth:bw=10,2x4xRTX-4090:nic=eth:bw=10,4x8xRTX-4090:nic=eth:bw=10,1x8xA100-80G-SXM:nic=eth:bw=10' 'FlashFlex (arXiv 2409.01143) heterogeneous cluster 3: 8x 3090 + 2 nodes of 4x 4090 + 4 nodes of 8x 4090 + 8x A100-80G with NVLink; nodes joined by TCP over 10 Gbit/s Ethernet (NIC speed assumed)'
profile paper-homo-a100-2x8 '2x8xA100-80G-PCIe:nic=eth:bw=10' 'FlashFlex (arXiv 2409.01143) homogeneous baseline: 2 nodes of 8x A100-80G PCIe, TCP over 10 Gbit/s Ethernet (no RDMA)'
profile paper-homo-a100-4x8 '4x8xA100-80G-PCIe:nic=eth:bw=10' 'FlashFlex (arXiv 2409.01143) homogeneous baseline: 4 nodes of 8x A100-80G PCIe, TCP over 10 Gbit/s Ethernet (no RDMA)'
profile holmes-mixed-nic '2x8xA100-80G-SXM:nic=ib:bw=200:name=ib,2x8xA100-80G-SXM:nic=roce:bw=200:name=roce,2x8xA100-80G-SXM:nic=eth:bw=25:name=eth' 'Mixed-NIC cluster in the spirit of Holmes (arXiv 2312.03549): NVLink A100-80G nodes, 2 on 200 Gbit/s InfiniBand, 2 on 200 Gbit/s RoCE, 2 on 25 Gbit/s Ethernet; IB and RoCE nodes reach each other only over Ethernet'
profile cpu-emulated '1x4xcpu:slowdown=2,2,4,4' 'Demo cluster for a CPU-only machine: one host, 4 emulated devices (2 and 4 times slower than a core), so that their total demand (1.5 cores) fits a 2-core host and the emulation stays faithful'
