/* The real node's nvidia-smi stand-in: nvidia-smi's default table, every figure from NVML (the node's fake
 * libnvidia-ml.so.1), through its linked symbols, so a preloaded libvgpu.so answers where it interposes, as
 * with the real nvidia-smi. Exit status 0, or NVML's error code when it cannot start, as nvidia-smi does. */
#include <stdio.h>
#include <string.h>
#include <time.h>

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef int nvmlReturn_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;

nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlShutdown(void);
nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length);
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version);
nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length);
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device);
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory);
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci);
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp);
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *milliwatts);
nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *milliwatts);
nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, int *state);
nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode);
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos);

#define RULE "+-----------------------------------------------------------------------------------------+"
#define CELLS "+-----------------------------------------+------------------------+----------------------+"
#define MAX_PROCESSES 64

static void device_rows(unsigned int index, nvmlDevice_t device) {
    char name[96] = "Unknown", bus[32] = "N/A";
    nvmlMemory_t memory = {0, 0, 0};
    nvmlPciInfo_t pci;
    nvmlUtilization_t busy = {0, 0};
    unsigned int temperature = 0, power = 0, cap = 0;
    int state = 0, persistence = 0;
    nvmlDeviceGetName(device, name, sizeof name);
    if (nvmlDeviceGetPciInfo_v3(device, &pci) == 0) snprintf(bus, sizeof bus, "%s", pci.busId);
    nvmlDeviceGetMemoryInfo(device, &memory);
    nvmlDeviceGetTemperature(device, 0, &temperature);
    nvmlDeviceGetPowerUsage(device, &power);
    nvmlDeviceGetEnforcedPowerLimit(device, &cap);
    nvmlDeviceGetPerformanceState(device, &state);
    nvmlDeviceGetPersistenceMode(device, &persistence);
    nvmlDeviceGetUtilizationRates(device, &busy);
    printf("| %3u  %-29.29s %-3s  |   %16s Off | %20d |\n", index, name, persistence ? "On" : "Off", bus, 0);
    printf("| N/A  %3uC    P%-2d %13uW / %4uW |  %6lluMiB / %6lluMiB | %6u%%      Default |\n", temperature, state, power / 1000,
           cap / 1000, memory.used >> 20, memory.total >> 20, busy.gpu);
    printf("|                                         |                        |                  N/A |\n");
}

static void process_rows(unsigned int index, nvmlDevice_t device, int *shown) {
    nvmlProcessInfo_t processes[MAX_PROCESSES];
    unsigned int count = MAX_PROCESSES;
    if (nvmlDeviceGetComputeRunningProcesses_v3(device, &count, processes) != 0) return;
    for (unsigned int i = 0; i < count; i++) {
        char name[256] = "";
        if (nvmlSystemGetProcessName(processes[i].pid, name, sizeof name) != 0) snprintf(name, sizeof name, "-");
        const char *base = strrchr(name, '/');
        printf("|  %3u   N/A  N/A  %10u      C   %-30.30s  %8lluMiB |\n", index, processes[i].pid, base ? base + 1 : name,
               processes[i].usedGpuMemory >> 20);
        (*shown)++;
    }
}

int main(void) {
    nvmlReturn_t rc = nvmlInit_v2();
    if (rc != 0) {
        printf("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver (NVML error %d).\n", rc);
        return rc;
    }
    char driver[80] = "N/A", cuda[16] = "N/A", when[64];
    int cuda_version = 0;
    unsigned int count = 0;
    nvmlSystemGetDriverVersion(driver, sizeof driver);
    if (nvmlSystemGetCudaDriverVersion(&cuda_version) == 0)
        snprintf(cuda, sizeof cuda, "%d.%d", cuda_version / 1000, cuda_version % 1000 / 10);
    time_t now = time(NULL);
    strftime(when, sizeof when, "%a %b %e %H:%M:%S %Y", localtime(&now));
    printf("%s\n%s\n", when, RULE);
    printf("| NVIDIA-SMI %-22s Driver Version: %-14s CUDA Version: %-8s |\n", driver, driver, cuda);
    printf("|-----------------------------------------+------------------------+----------------------+\n");
    printf("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |\n");
    printf("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |\n");
    printf("|                                         |                        |               MIG M. |\n");
    printf("|=========================================+========================+======================|\n");
    nvmlDeviceGetCount_v2(&count);
    for (unsigned int i = 0; i < count; i++) {
        nvmlDevice_t device;
        if (nvmlDeviceGetHandleByIndex_v2(i, &device) == 0) device_rows(i, device);
        printf("%s\n", CELLS);
    }
    printf("\n%s\n", RULE);
    printf("| Processes:                                                                              |\n");
    printf("|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |\n");
    printf("|        ID   ID                                                               Usage      |\n");
    printf("|=========================================================================================|\n");
    int shown = 0;
    for (unsigned int i = 0; i < count; i++) {
        nvmlDevice_t device;
        if (nvmlDeviceGetHandleByIndex_v2(i, &device) == 0) process_rows(i, device, &shown);
    }
    if (!shown) printf("|  No running processes found                                                             |\n");
    printf("%s\n", RULE);
    nvmlShutdown();
    return 0;
}
