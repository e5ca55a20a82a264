/* Test driver for the grant reader alone: length-prefixed inputs on stdin (4-byte little-endian
 * length, then the bytes), one line out per input: "ok <count> <uuid as hex>=<limit>..." or "malformed".
 * Built with AddressSanitizer and UBSan, so a read past any input ends the run. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "vgpu.h"

int main(void) {
    unsigned char header[4];
    while (fread(header, 1, sizeof header, stdin) == sizeof header) {
        size_t len = (size_t)header[0] | (size_t)header[1] << 8 | (size_t)header[2] << 16 | (size_t)header[3] << 24;
        char *text = malloc(len ? len : 1); /* exactly the input: no terminator to lean on */
        if (!text || fread(text, 1, len, stdin) != len) return 2;
        struct vgpu_grant grant;
        if (vgpu_grant_parse(text, len, &grant) != 0) {
            puts("malformed");
        } else {
            printf("ok %d", grant.count);
            for (int i = 0; i < grant.count; i++) {
                putchar(' ');
                for (const unsigned char *c = (const unsigned char *)grant.devices[i].uuid; *c; c++) printf("%02x", *c);
                printf("=%llu", (unsigned long long)grant.devices[i].limit);
            }
            putchar('\n');
        }
        free(text);
    }
    return 0;
}
