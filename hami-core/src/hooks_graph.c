/* Device memory the library cannot count exactly is kept out under a limit: a graph's memory
 * nodes allocate when the graph is launched, possibly many times and in no order the library
 * sees (refused), and a pool told to keep freed memory (a release threshold) would hold it
 * after the frees that gave the charge back (the threshold is not passed on: the pool keeps
 * releasing at once, which costs speed, never memory). Without a limit these are the driver's. */
#include "vgpu.h"

/* CUDA_SUCCESS when the current device has no limit (without a current context: when no device
 * has one, and the driver gives its own answer), else the refusal. */
static CUresult unlimited_here(const char *what) {
    int idx;
    if (vgpu_current_index(&idx) != CUDA_SUCCESS) {
        if (!vgpu_config_any_limit()) return CUDA_SUCCESS;
        idx = -1;
    } else if (vgpu_ledger_limit(idx) == VGPU_UNLIMITED) {
        return CUDA_SUCCESS;
    }
    vgpu_log(VGPU_LOG_INFO, "device %d: %s is not applied under a memory limit", idx, what);
    return CUDA_ERROR_NOT_SUPPORTED;
}

#define REQUIRE(fn)                                                   \
    do {                                                              \
        if (vgpu_cuda_load() != 0) return CUDA_ERROR_NOT_INITIALIZED; \
        if (!vgpu_cuda.fn) return CUDA_ERROR_NOT_FOUND;               \
    } while (0)

VGPU_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                            CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    REQUIRE(cuGraphAddMemAllocNode);
    CUresult rc = unlimited_here("a graph memory allocation node");
    return rc != CUDA_SUCCESS ? rc : vgpu_cuda.cuGraphAddMemAllocNode(node, graph, deps, ndeps, params);
}

static int allocates(const CUgraphNodeParams *params) { return params && params->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC; }

VGPU_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                       const CUgraphEdgeData *edges, size_t ndeps, CUgraphNodeParams *params) {
    REQUIRE(cuGraphAddNode_v2);
    CUresult rc = allocates(params) ? unlimited_here("a graph memory allocation node") : CUDA_SUCCESS;
    return rc != CUDA_SUCCESS ? rc : vgpu_cuda.cuGraphAddNode_v2(node, graph, deps, edges, ndeps, params);
}

VGPU_EXPORT CUresult vgpu_graph_add_node_v1_hook(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                                 CUgraphNodeParams *params) {
    REQUIRE(graph_add_node_v1);
    CUresult rc = allocates(params) ? unlimited_here("a graph memory allocation node") : CUDA_SUCCESS;
    return rc != CUDA_SUCCESS ? rc : vgpu_cuda.graph_add_node_v1(node, graph, deps, ndeps, params);
}

/* A threshold of 0 (the default) lets the pool return freed memory at the next synchronisation,
 * which is what the charge released at free assumes. Clients raise it for speed (cuda.core's
 * default memory resource does, and stops if refused), so under a limit the call succeeds and the
 * pool keeps its threshold of 0. */
VGPU_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    REQUIRE(cuMemPoolSetAttribute);
    if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD && pool && value && *(const cuuint64_t *)value != 0 &&
        unlimited_here("a memory pool release threshold") != CUDA_SUCCESS)
        return CUDA_SUCCESS;
    return vgpu_cuda.cuMemPoolSetAttribute(pool, attr, value);
}
