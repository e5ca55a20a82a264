/* The real node's sandbox ("pause") program: holds a pod's namespaces, reaps orphans, leaves on SIGINT/SIGTERM.
 * Built static, so its image is this one file. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void leave(int signo) { (void)signo; _exit(0); }

static void reap(int signo) {
    (void)signo;
    while (waitpid(-1, NULL, WNOHANG) > 0) {}
}

int main(void) {
    struct sigaction quit = {.sa_handler = leave}, child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    if (sigaction(SIGINT, &quit, NULL) || sigaction(SIGTERM, &quit, NULL) || sigaction(SIGCHLD, &child, NULL)) return 1;
    for (;;) pause();
}
