"""Values recorded from real devices, shaped exactly as the vendor libraries return them."""
from __future__ import annotations

from types import SimpleNamespace

GIB = 1024**3

# pynvml on an H100 SXM (driver 550.54.15): nvmlDeviceGetMemoryInfo returns a c_nvmlMemory_t
# with total/free/used in bytes; nvmlDeviceGetUtilizationRates a c_nvmlUtilization_t (.gpu, .memory).
NVML_H100 = {
    "name": "NVIDIA H100 80GB HBM3",
    "uuid": "GPU-6d4c5e4a-8b51-7f2e-93c1-0a1b2c3d4e5f",
    "memory": SimpleNamespace(total=85520809984, free=84950908928, used=569901056),
    "utilization": SimpleNamespace(gpu=37, memory=12),
    "temperature": 41,
    "capability": (9, 0),
    "driver_version": "550.54.15",
}
# nvidia-ml-py before 11.5 returned bytes for strings.
NVML_H200_BYTES = {
    "name": b"NVIDIA H200",
    "uuid": b"GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
    "memory": SimpleNamespace(total=150754820096, free=150221160448, used=533659648),
    "utilization": None,  # NVMLError_NotSupported on this board
    "temperature": None,
    "capability": (9, 0),
    "driver_version": b"560.35.03",
}

# amdsmi 6.x on an MI300X: vram in MB, gfx_activity in %, temperature in °C.
AMDSMI_MI300X = {
    "asic": {
        "market_name": "AMD Instinct MI300X", "vendor_id": "0x1002", "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
        "subvendor_id": "0x1002", "device_id": "0x74a1", "rev_id": "0x00", "asic_serial": "0x2F3E4D5C6B7A8901",
        "oam_id": 0, "num_compute_units": 304, "target_graphics_version": "gfx942",
    },
    "vram": {"vram_type": 13, "vram_vendor": "HYNIX", "vram_size": 196592, "vram_total": 196592, "vram_used": 283},
    "activity": {"gfx_activity": 0, "umc_activity": 0, "mm_activity": "N/A"},
    "temperature": 38,
    "uuid": "2dff74a1-0000-1000-807f-1a2b3c4d5e6f",
    "driver": {"driver_name": "amdgpu", "driver_version": "6.8.5", "driver_date": "2015/01/01 00:00"},
}
AMDSMI_RX7900XTX = {
    "asic": {
        "market_name": "Radeon RX 7900 XTX", "vendor_id": "0x1002", "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
        "subvendor_id": "0x1eae", "device_id": "0x744c", "rev_id": "0xc8", "asic_serial": "0xFFFFFFFFFFFFFFFF",
        "oam_id": "N/A", "num_compute_units": 96, "target_graphics_version": "gfx1100",
    },
    "vram": {"vram_type": 11, "vram_vendor": "SAMSUNG", "vram_size": 24560, "vram_total": 24560, "vram_used": 1240},
    "activity": {"gfx_activity": 3, "umc_activity": 1, "mm_activity": 0},
    "temperature": "N/A",
    "uuid": "c4ff744c-0000-1000-80d3-000000000000",
    "driver": {"driver_name": "amdgpu", "driver_version": "6.10.5", "driver_date": "2015/01/01 00:00"},
}

# `llama-server --version` of real builds (stderr and stdout together).
LLAMA_SERVER_CUDA = """ggml_cuda_init: GGML_CUDA_FORCE_MMQ:    no
ggml_cuda_init: GGML_CUDA_FORCE_CUBLAS: no
ggml_cuda_init: found 1 CUDA devices:
  Device 0: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes
version: 4880 (2c9f833d)
built with cc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0 for x86_64-linux-gnu
"""
LLAMA_SERVER_ROCM = """ggml_cuda_init: GGML_CUDA_FORCE_MMQ:    no
ggml_cuda_init: GGML_CUDA_FORCE_CUBLAS: no
ggml_cuda_init: found 1 ROCm devices:
  Device 0: AMD Instinct MI300X, gfx942:sramecc+:xnack- (0x942), VMM: no, Wave Size: 64
version: 5002 (d5a4bc1a)
built with AMD clang version 18.0.0git for x86_64-unknown-linux-gnu
"""
LLAMA_SERVER_VULKAN = """ggml_vulkan: Found 1 Vulkan devices:
ggml_vulkan: 0 = AMD Radeon RX 7900 XTX (RADV NAVI31) (radv) | uma: 0 | fp16: 1 | warp size: 64 | shared memory: 65536 | int dot: 1 | matrix cores: KHR_coopmat
version: 5123 (0f2bbe65)
built with cc (Debian 12.2.0-14) 12.2.0 for x86_64-linux-gnu
"""
LLAMA_SERVER_CPU = """version: 6080 (a0552c8b)
built with cc (Debian 12.2.0-14) 12.2.0 for x86_64-linux-gnu
"""
# Builds that load ggml backends at run time print which one they loaded.
LLAMA_SERVER_DYNAMIC_CUDA = """load_backend: loaded CUDA backend from /app/libggml-cuda.so
load_backend: loaded CPU backend from /app/libggml-cpu-icelake.so
version: 6123 (79c1160b)
built with cc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0 for x86_64-linux-gnu
"""
LDD_ROCM = """	linux-vdso.so.1 (0x00007ffc8b3f2000)
	libllama.so => /opt/llama/lib/libllama.so (0x00007f2a3c000000)
	libamdhip64.so.6 => /opt/rocm/lib/libamdhip64.so.6 (0x00007f2a3a000000)
	libhipblas.so.2 => /opt/rocm/lib/libhipblas.so.2 (0x00007f2a39000000)
	libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2a38e00000)
"""

# nvmlDeviceGetComputeRunningProcesses on an H100 with two vLLM workers of one backend (pids 4711,
# 4712) and another user's process: c_nvmlProcessInfo_t (v3) with usedGpuMemory in bytes, and None
# where the driver cannot attribute it (seen in containers without the host PID namespace).
NVML_PROCESSES_H100 = [
    SimpleNamespace(pid=4711, usedGpuMemory=70_891_143_168, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF),
    SimpleNamespace(pid=4712, usedGpuMemory=536_870_912, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF),
    SimpleNamespace(pid=9001, usedGpuMemory=None, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF),
]
# amdsmi 6.x amdsmi_get_gpu_process_list on an MI300X: dicts, memory in bytes.
AMDSMI_PROCESSES_MI300X = [
    {"name": "llama-server", "pid": 5150, "mem": 4_404_019_200,
     "engine_usage": {"gfx": 0, "enc": 0}, "memory_usage": {"gtt_mem": 2_097_152, "cpu_mem": 0, "vram_mem": 4_294_967_296},
     "cu_occupancy": 0},
    {"name": "python3", "pid": 6160, "mem": 1_048_576, "engine_usage": {"gfx": 0, "enc": 0},
     "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": 1_048_576}, "cu_occupancy": 0},
]
