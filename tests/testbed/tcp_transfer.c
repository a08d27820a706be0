/* One TCP transfer between two testbed hosts, timed by the receiver.
 *   tcp_transfer recv PORT BYTES        accepts one connection on PORT, reads
 *                                       BYTES and prints "received B bytes in
 *                                       S s" (S from the first byte to the last)
 *   tcp_transfer send ADDR PORT BYTES   connects to ADDR:PORT (retrying for up
 *                                       to 60 s while nothing listens) and sends
 *                                       BYTES
 * Exits 0 when all BYTES went through, 1 otherwise, 2 on bad arguments. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int fail(const char *what) {
  fprintf(stderr, "tcp_transfer: %s: %s\n", what, strerror(errno));
  return 1;
}

static long long parse_count(const char *text, long long max) {
  char *end = NULL;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  return errno != 0 || *end != '\0' || v < 1 || v > max ? -1 : v;
}

static int receive(int port, long long bytes) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) return fail("socket");
  int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in addr = {0};
  addr.sin_family = AF_INET;
  addr.sin_port = htons((unsigned short)port);
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  if (bind(listener, (struct sockaddr *)&addr, sizeof addr) != 0) return fail("bind");
  if (listen(listener, 1) != 0) return fail("listen");
  int fd = accept(listener, NULL, NULL);
  if (fd < 0) return fail("accept");
  static char buf[1 << 16];
  long long got = 0;
  double first = 0, last = 0;
  while (got < bytes) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    last = now_seconds();
    if (got == 0) first = last;
    got += n;
  }
  close(fd);
  close(listener);
  printf("received %lld bytes in %.6f s\n", got, last - first);
  return got == bytes ? 0 : 1;
}

static int send_all(const char *host, int port, long long bytes) {
  struct sockaddr_in addr = {0};
  addr.sin_family = AF_INET;
  addr.sin_port = htons((unsigned short)port);
  if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) {
    fprintf(stderr, "tcp_transfer: ADDR takes an IPv4 address, not '%s'\n", host);
    return 2;
  }
  int fd = -1;
  const double deadline = now_seconds() + 60;
  for (;;) {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return fail("socket");
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0) break;
    close(fd);
    if (now_seconds() > deadline) return fail("connect (60 s)");
    struct timespec pause = {0, 10 * 1000 * 1000};
    nanosleep(&pause, NULL); /* the receiver is not listening yet */
  }
  static char buf[1 << 16];
  memset(buf, 0x5a, sizeof buf);
  long long sent = 0;
  while (sent < bytes) {
    size_t chunk = bytes - sent < (long long)sizeof buf ? (size_t)(bytes - sent) : sizeof buf;
    ssize_t n = write(fd, buf, chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail("write");
    sent += n;
  }
  close(fd);
  return 0;
}

int main(int argc, char **argv) {
  const long long max_bytes = 1LL << 40;
  if (argc == 4 && strcmp(argv[1], "recv") == 0) {
    long long port = parse_count(argv[2], 65535), bytes = parse_count(argv[3], max_bytes);
    if (port > 0 && bytes > 0) return receive((int)port, bytes);
  } else if (argc == 5 && strcmp(argv[1], "send") == 0) {
    long long port = parse_count(argv[3], 65535), bytes = parse_count(argv[4], max_bytes);
    if (port > 0 && bytes > 0) return send_all(argv[2], (int)port, bytes);
  }
  fprintf(stderr, "usage: tcp_transfer recv PORT BYTES | send ADDR PORT BYTES\n");
  return 2;
}
