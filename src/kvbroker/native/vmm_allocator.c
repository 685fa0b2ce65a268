/* kvbroker's VMM allocator for torch.cuda.MemPool (CUDAPluggableAllocator).
 *
 * Every allocation is its own CUDA VMM allocation (cuMemCreate) made with the
 * POSIX-fd handle type, mapped read-write for its device: memory the broker
 * can import by fd (EngineMemory.adopt exports it with
 * cuMemRetainAllocationHandle + cuMemExportToShareableHandle). Engines put
 * their KV cache in it through their allocator hook (vLLM's connector
 * get_mem_pool_context, SGLang's custom memory pool). GPUDirect RDMA is asked
 * for when the device supports it with VMM.
 *
 * The driver is loaded with dlopen("libcuda.so.1") on first use; tests hand
 * in their own function table (kvbroker_vmm_set_driver) instead. No CUDA
 * headers are needed: the few types are declared here as cuda.h lays them
 * out on 64-bit Linux.
 *
 * Status: compiled and driven against the scripted fake driver on CPU; never
 * run on a GPU.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct {
    int type;
    int id;
} CUmemLocation;

typedef struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
} CUmemAllocFlags;

typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    CUmemAllocFlags allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;

enum {
    HANDLE_TYPE_POSIX_FD = 0x1,
    ALLOCATION_TYPE_PINNED = 0x1,
    LOCATION_TYPE_DEVICE = 0x1,
    ACCESS_READWRITE = 0x3,
    GRANULARITY_MINIMUM = 0x0,
    ATTRIBUTE_RDMA_WITH_VMM = 110,
};

/* The driver functions this file calls, in this order (kvbroker_vmm_set_driver). */
typedef struct {
    CUresult (*cuDeviceGetAttribute)(int *, int, int);
    CUresult (*cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
    CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
    CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
    CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
    CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
} Driver;

static Driver driver;
static int driver_loaded;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* Live allocations: address -> (handle, mapped size). */
typedef struct {
    CUdeviceptr address;
    size_t size;
    CUmemGenericAllocationHandle handle;
} Allocation;

static Allocation *live;
static size_t live_count, live_capacity;

void kvbroker_vmm_set_driver(const Driver *table) {
    pthread_mutex_lock(&lock);
    driver = *table;
    driver_loaded = 1;
    pthread_mutex_unlock(&lock);
}

static int load_driver(void) {
    if (driver_loaded) return 1;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
#define LOAD(name) driver.name = dlsym(lib, #name); if (!driver.name) return 0
    LOAD(cuDeviceGetAttribute);
    LOAD(cuMemGetAllocationGranularity);
    LOAD(cuMemCreate);
    LOAD(cuMemRelease);
    LOAD(cuMemAddressReserve);
    LOAD(cuMemAddressFree);
    LOAD(cuMemMap);
    LOAD(cuMemUnmap);
    LOAD(cuMemSetAccess);
#undef LOAD
    driver_loaded = 1;
    return 1;
}

static int remember(CUdeviceptr address, size_t size, CUmemGenericAllocationHandle handle) {
    if (live_count == live_capacity) {
        size_t capacity = live_capacity ? 2 * live_capacity : 64;
        Allocation *grown = realloc(live, capacity * sizeof(Allocation));
        if (!grown) return 0;
        live = grown;
        live_capacity = capacity;
    }
    live[live_count++] = (Allocation){address, size, handle};
    return 1;
}

/* torch's CUDAPluggableAllocator signature: void* alloc(ssize_t size, int device, cudaStream_t stream). */
void *kvbroker_vmm_malloc(ssize_t size, int device, void *stream) {
    (void)stream;
    void *result = NULL;
    pthread_mutex_lock(&lock);
    if (size <= 0 || !load_driver()) goto out;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = HANDLE_TYPE_POSIX_FD;
    prop.location.type = LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    int rdma = 0;
    if (driver.cuDeviceGetAttribute(&rdma, ATTRIBUTE_RDMA_WITH_VMM, device) == 0 && rdma)
        prop.allocFlags.gpuDirectRDMACapable = 1;
    size_t granularity = 0;
    if (driver.cuMemGetAllocationGranularity(&granularity, &prop, GRANULARITY_MINIMUM) != 0 || !granularity) goto out;
    size_t rounded = ((size_t)size + granularity - 1) / granularity * granularity;
    CUmemGenericAllocationHandle handle = 0;
    if (driver.cuMemCreate(&handle, rounded, &prop, 0) != 0) goto out;
    CUdeviceptr address = 0;
    if (driver.cuMemAddressReserve(&address, rounded, granularity, 0, 0) != 0) goto release;
    if (driver.cuMemMap(address, rounded, 0, handle, 0) != 0) goto free_range;
    CUmemAccessDesc access = {{LOCATION_TYPE_DEVICE, device}, ACCESS_READWRITE};
    if (driver.cuMemSetAccess(address, rounded, &access, 1) != 0) goto unmap;
    if (!remember(address, rounded, handle)) goto unmap;
    result = (void *)(uintptr_t)address;
    goto out;
unmap:
    driver.cuMemUnmap(address, rounded);
free_range:
    driver.cuMemAddressFree(address, rounded);
release:
    driver.cuMemRelease(handle);
out:
    pthread_mutex_unlock(&lock);
    return result;
}

/* void free(void* ptr, ssize_t size, int device, cudaStream_t stream). */
void kvbroker_vmm_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size;
    (void)device;
    (void)stream;
    pthread_mutex_lock(&lock);
    CUdeviceptr address = (CUdeviceptr)(uintptr_t)ptr;
    for (size_t i = 0; i < live_count; i++) {
        if (live[i].address != address) continue;
        Allocation a = live[i];
        live[i] = live[--live_count];
        driver.cuMemUnmap(a.address, a.size);
        driver.cuMemAddressFree(a.address, a.size);
        driver.cuMemRelease(a.handle);
        break;
    }
    pthread_mutex_unlock(&lock);
}

/* How many allocations are live (for tests). */
size_t kvbroker_vmm_live(void) {
    pthread_mutex_lock(&lock);
    size_t n = live_count;
    pthread_mutex_unlock(&lock);
    return n;
}
