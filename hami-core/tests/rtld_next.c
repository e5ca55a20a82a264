/* Calls the interposed getppid from librtldnext.so and prints what the chain returned. */
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(void) {
    long chained = (long)getppid();
    long direct = syscall(SYS_getppid);
    printf("chained=%ld direct=%ld match=%d\n", chained, direct, chained == direct);
    return chained == direct ? 0 : 1;
}
