/* dp-c-api-slots: checks the loaded library's dp_get_api() table slot by
 * slot against a frozen list of names: slot i must hold the address that
 * dlsym gives for "dp_" + the i-th name. Two slots of the same type swapped
 * in DP_API_SLOTS compile fine and pass every type check; this catches them.
 *
 *   dp-c-api-slots LIBRARY tests/abi/api_slots.txt
 */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "dparallel/dp_api.h"

typedef void (*any_fn)(void);

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: dp-c-api-slots LIBRARY SLOT_NAMES_FILE\n");
    return 2;
  }
  FILE *names = fopen(argv[2], "r");
  if (names == NULL) {
    perror(argv[2]);
    return 2;
  }
  void *handle = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (handle == NULL) {
    fprintf(stderr, "cannot load %s: %s\n", argv[1], dlerror());
    fclose(names);
    return 2;
  }
  void *symbol = dlsym(handle, "dp_get_api");
  const dp_api *(*get_api)(uint32_t) = NULL;
  if (symbol != NULL) memcpy(&get_api, &symbol, sizeof get_api);
  const dp_api *api = get_api != NULL ? get_api(DP_VERSION_MAJOR) : NULL;
  if (api == NULL) {
    fprintf(stderr, "%s: no dp_get_api table for major %d\n", argv[1], DP_VERSION_MAJOR);
    fclose(names);
    dlclose(handle);
    return 2;
  }

  const size_t first = offsetof(dp_api, status_string);
  const unsigned char *table = (const unsigned char *)api;
  size_t count = 0;
  int failures = 0;
  char line[256];
  while (fgets(line, sizeof line, names) != NULL) {
    line[strcspn(line, "\r\n")] = '\0';
    if (line[0] == '\0' || line[0] == '#') continue;
    char symbol_name[300];
    snprintf(symbol_name, sizeof symbol_name, "dp_%s", line);
    size_t offset = first + count * sizeof(any_fn);
    ++count;
    if (offset + sizeof(any_fn) > api->struct_size) {
      fprintf(stderr, "slot %zu (%s): beyond the table's %zu bytes\n", count - 1, symbol_name, api->struct_size);
      ++failures;
      continue;
    }
    any_fn in_table, expected = NULL;
    memcpy(&in_table, table + offset, sizeof in_table);
    void *address = dlsym(handle, symbol_name);
    if (address == NULL) {
      fprintf(stderr, "slot %zu: the library exports no %s\n", count - 1, symbol_name);
      ++failures;
      continue;
    }
    memcpy(&expected, &address, sizeof expected);
    if (in_table != expected) {
      Dl_info info;
      const char *held = "?";
      void *held_address;
      memcpy(&held_address, &in_table, sizeof held_address);
      if (dladdr(held_address, &info) != 0 && info.dli_sname != NULL) held = info.dli_sname;
      fprintf(stderr, "slot %zu: holds %s, not %s\n", count - 1, held, symbol_name);
      ++failures;
    }
  }
  fclose(names);
  size_t slots = (api->struct_size - first) / sizeof(any_fn);
  if (slots != count) {
    fprintf(stderr, "the table has %zu slots, the frozen list %zu: append new slots' names to %s\n", slots, count,
            argv[2]);
    ++failures;
  }
  dlclose(handle);
  if (failures != 0) {
    fprintf(stderr, "FAIL: %d slot(s) differ from %s\n", failures, argv[2]);
    return 1;
  }
  printf("all %zu slots of the dp_api table hold the functions their names say\n", count);
  return 0;
}
