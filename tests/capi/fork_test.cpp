// A forked child inherits its parent's stores, groups, meshes, works and dp_ddp but
// none of its threads: every call on them there is DP_ESTATE, destroying
// them there touches nothing of the parent's, and the parent carries on.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "test_util.h"

namespace {

// Runs `child` in a forked child and returns its exit code (-1: it did not
// end within 60 s, or died of a signal).
template <typename Child>
int in_forked_child(Child&& child) {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(child());
  if (pid < 0) return -1;
  int status = 0;
  for (int i = 0; i < 6000; ++i) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    ::usleep(10000);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

// In the child: 0 when `status` is DP_ESTATE saying this is a forked child,
// else 1 (and the message on stderr).
int refused_in_child(const char* what, dp_status status) {
  std::string m = dp_last_error();
  if (status == DP_ESTATE && m.find("forked child") != std::string::npos) return 0;
  std::fprintf(stderr, "child: %s gave %d: %s\n", what, status, m.c_str());
  return 1;
}

TEST(Fork, ChildIsRefusedEveryCallOnInheritedHandlesAndTheParentCarriesOn) {
  dp_store* server = nullptr;
  DP_ASSERT_OK(dp_store_create_tcp(&server, "127.0.0.1", 0, 1, 1, 30000));
  DP_ASSERT_OK(dp_store_set(server, "before", "1", 1));
  dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
  o.rank = 0;
  o.world_size = 1;
  o.store = server;
  o.timeout_ms = 30000;
  dp_process_group* pg = nullptr;
  DP_ASSERT_OK(dp_process_group_create(&pg, &o));
  dp_module* module = nullptr;
  DP_ASSERT_OK(dp_module_create(&module));
  int64_t shape[1] = {4};
  dp_tensor* weight = nullptr;
  DP_ASSERT_OK(dp_tensor_create(&weight, DP_FLOAT32, 1, shape, dp_device{DP_DEVICE_CPU, 0}));
  DP_ASSERT_OK(dp_module_register_parameter(module, "w", weight, 1));
  dp_ddp* ddp = nullptr;
  DP_ASSERT_OK(dp_ddp_create(&ddp, module, pg, nullptr));
  dp_tensor* t = nullptr;
  DP_ASSERT_OK(dp_tensor_create(&t, DP_FLOAT32, 1, shape, dp_device{DP_DEVICE_CPU, 0}));
  const int32_t mesh_shape[1] = {1};
  dp_device_mesh* mesh = nullptr;
  DP_ASSERT_OK(dp_device_mesh_create(&mesh, pg, mesh_shape, 1, nullptr));
  dp_process_group* mesh_group = nullptr;
  DP_ASSERT_OK(dp_device_mesh_group(mesh, "dim0", &mesh_group));
  dp_work* work = nullptr;
  DP_ASSERT_OK(dp_pg_all_reduce_async(pg, t, DP_SUM, &work));
  DP_ASSERT_OK(dp_work_wait(work));

  int code = in_forked_child([&] {
    int bad = 0;
    bad += refused_in_child("dp_store_set", dp_store_set(server, "child", "1", 1));
    size_t len = 0;
    char buf[8];
    bad += refused_in_child("dp_store_get", dp_store_get(server, "before", buf, sizeof(buf), &len));
    bad += refused_in_child("dp_pg_all_reduce", dp_pg_all_reduce(pg, t, DP_SUM));
    bad += refused_in_child("dp_pg_barrier", dp_pg_barrier(pg));
    bad += refused_in_child("dp_work_wait", dp_work_wait(work));
    bad += refused_in_child("dp_ddp_mark_grad_ready", dp_ddp_mark_grad_ready(ddp, "w"));
    bad += refused_in_child("dp_ddp_finish_backward", dp_ddp_finish_backward(ddp));
    dp_process_group* child_group = nullptr;
    bad +=
        refused_in_child("dp_process_group_create over the inherited store", dp_process_group_create(&child_group, &o));
    bad += refused_in_child("dp_process_group_split", dp_process_group_split(pg, 0, 0, nullptr, &child_group));
    dp_device_mesh* child_mesh = nullptr;
    bad += refused_in_child("dp_device_mesh_create", dp_device_mesh_create(&child_mesh, pg, mesh_shape, 1, nullptr));
    int32_t coordinate[1];
    bad += refused_in_child("dp_device_mesh_coordinate", dp_device_mesh_coordinate(mesh, coordinate, 1));
    bad += refused_in_child("dp_pg_all_reduce on a mesh's group", dp_pg_all_reduce(mesh_group, t, DP_SUM));
    // None of these may stop the parent's store server, groups or mesh.
    dp_device_mesh_destroy(mesh);
    dp_ddp_destroy(ddp);
    dp_work_destroy(work);
    dp_process_group_destroy(pg);
    dp_store_destroy(server);
    return bad;
  });
  EXPECT_EQ(code, 0) << "the child's checks failed (its stderr above)";

  // The parent's store, group and dp_ddp work as before.
  DP_EXPECT_OK(dp_work_wait(work));
  dp_work_destroy(work);
  size_t len = 0;
  char buf[8];
  DP_EXPECT_OK(dp_store_get(server, "before", buf, sizeof(buf), &len));
  DP_EXPECT_OK(dp_store_set(server, "after", "2", 1));
  DP_EXPECT_OK(dp_pg_all_reduce(pg, t, DP_SUM));
  DP_EXPECT_OK(dp_pg_all_reduce(mesh_group, t, DP_SUM));
  dp_device_mesh_destroy(mesh);
  DP_EXPECT_OK(dp_ddp_mark_grad_ready(ddp, "w"));
  DP_EXPECT_OK(dp_ddp_finish_backward(ddp));
  dp_ddp_destroy(ddp);
  dp_tensor_destroy(t);
  dp_tensor_destroy(weight);
  dp_module_destroy(module);
  dp_process_group_destroy(pg);
  dp_store_destroy(server);
}

}  // namespace
