/* What a hostile tenant does to reach the driver without any dynamic-linker lookup that a
 * preloaded library could answer: find libcuda.so.1's image among the loaded objects and read
 * its ELF dynamic symbol table by hand (GNU or SysV hash), as its own loader would. */
#ifndef ELF_LOOKUP_H
#define ELF_LOOKUP_H

#ifndef _GNU_SOURCE
#error "define _GNU_SOURCE before any include (dl_iterate_phdr)"
#endif
#include <elf.h>
#include <link.h>
#include <stdint.h>
#include <string.h>

struct elf_query {
    const char *object; /* a substring of the object's path, e.g. "libcuda.so" */
    const char *symbol;
    void *found;
};

/* Symbols in a GNU hash table: past the highest bucket's chain, which ends at an odd hash. */
static size_t gnu_hash_symbols(const uint32_t *table) {
    uint32_t nbuckets = table[0], symoffset = table[1], bloom = table[2];
    const uint32_t *buckets = table + 4 + bloom * (sizeof(ElfW(Addr)) / 4);
    const uint32_t *chain = buckets + nbuckets;
    uint32_t last = 0;
    for (uint32_t i = 0; i < nbuckets; i++)
        if (buckets[i] > last) last = buckets[i];
    if (last < symoffset) return symoffset;
    while (!(chain[last - symoffset] & 1)) last++;
    return last + 1;
}

static int elf_visit(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct elf_query *q = data;
    if (!info->dlpi_name || !strstr(info->dlpi_name, q->object)) return 0;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    if (!dyn) return 0;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    size_t count = 0;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        /* glibc relocates these entries in place on most targets; where it does not, they are
         * still offsets from the load address. */
        ElfW(Addr) at = dyn->d_un.d_ptr < info->dlpi_addr ? dyn->d_un.d_ptr + info->dlpi_addr : dyn->d_un.d_ptr;
        if (dyn->d_tag == DT_SYMTAB) symtab = (const ElfW(Sym) *)at;
        if (dyn->d_tag == DT_STRTAB) strtab = (const char *)at;
        if (dyn->d_tag == DT_HASH && !count) count = ((const uint32_t *)at)[1];
        if (dyn->d_tag == DT_GNU_HASH) count = gnu_hash_symbols((const uint32_t *)at);
    }
    if (!symtab || !strtab) return 0;
    for (size_t i = 0; i < count; i++) {
        if (symtab[i].st_shndx == SHN_UNDEF || ELF64_ST_TYPE(symtab[i].st_info) != STT_FUNC) continue;
        if (strcmp(strtab + symtab[i].st_name, q->symbol) == 0) {
            q->found = (void *)(info->dlpi_addr + symtab[i].st_value);
            return 1;
        }
    }
    return 0;
}

static void *elf_lookup(const char *object, const char *symbol) {
    struct elf_query q = {object, symbol, NULL};
    dl_iterate_phdr(elf_visit, &q);
    return q.found;
}

#endif
