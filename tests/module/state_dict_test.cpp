#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>

#include "module/module_test_util.h"

using namespace dptest;

namespace {

std::string temp_path(const std::string& name) { return dptest::temp_path("dp_state_dict_", name); }

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

// A safetensors image with `header` as its JSON and `data` after it.
std::string image(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

// fc (weight 2x3 float32, bias 2 float32), a persistent int64 buffer "count"
// and a non-persistent buffer "scratch".
ModulePtr model(float start) {
  ModulePtr root = new_module();
  auto fc = linear(3, 2, start);
  DP_EXPECT_OK(dp_module_register_module(root.get(), "fc", fc.get()));
  auto count = make<int64_t>({1}, {static_cast<int64_t>(start)});
  DP_EXPECT_OK(dp_module_register_buffer(root.get(), "count", count.get(), 1));
  auto scratch = make<float>({4}, {1, 2, 3, 4});
  DP_EXPECT_OK(dp_module_register_buffer(root.get(), "scratch", scratch.get(), 0));
  return root;
}

// CRC-32C one bit at a time: a second implementation to check the library's against.
uint32_t crc32c_bitwise(const std::string& bytes) {
  uint32_t crc = ~0u;
  for (unsigned char b : bytes) {
    crc ^= b;
    for (int i = 0; i < 8; ++i) crc = (crc >> 1) ^ ((crc & 1u) ? 0x82f63b78u : 0u);
  }
  return ~crc;
}

}  // namespace

TEST(StateDict, FileFollowsTheSafetensorsLayout) {
  ModulePtr m = model(1.0f);
  std::string path = temp_path("layout.safetensors");
  DP_ASSERT_OK(dp_module_save(m.get(), path.c_str()));
  std::string bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  EXPECT_EQ(n % 8, 0u);
  std::string header = bytes.substr(8, n);
  // The metadata: the data section's CRC-32C, then the format.
  const std::string checksum_key = "{\"__metadata__\":{\"dp.crc32c\":\"";
  ASSERT_EQ(header.rfind(checksum_key, 0), 0u) << header;
  char stated[16];
  std::snprintf(stated, sizeof stated, "%08x", crc32c_bitwise(bytes.substr(8 + n)));
  EXPECT_EQ(header.substr(checksum_key.size(), 8), stated) << header;
  EXPECT_EQ(header.find("\",\"format\":\"pt\"},", checksum_key.size() + 8), checksum_key.size() + 8) << header;
  // state_dict() order: the root's own tensors, then each child's.
  EXPECT_TRUE(contains(header,
                       "\"count\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]},"
                       "\"fc.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[8,32]},"
                       "\"fc.bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[32,40]}}"))
      << header;
  EXPECT_FALSE(contains(header, "scratch"));  // not persistent
  EXPECT_EQ(bytes.size(), 8 + n + 40);
  float first = 0;
  std::memcpy(&first, bytes.data() + 8 + n + 8, sizeof first);
  EXPECT_EQ(first, 1.0f);
  std::remove(path.c_str());
}

TEST(StateDict, RoundTripIsByteIdenticalOnResave) {
  ModulePtr source = model(1.0f);
  ModulePtr target = model(9.0f);
  std::string first = temp_path("first.safetensors"), second = temp_path("second.safetensors");
  DP_ASSERT_OK(dp_module_save(source.get(), first.c_str()));
  DP_ASSERT_OK(dp_module_load(target.get(), first.c_str(), 1));
  EXPECT_EQ(values<float>(parameter(target.get(), "fc.weight").get()), iota<float>(6, 1.0f));
  dp_tensor* count = nullptr;
  DP_ASSERT_OK(dp_module_get_buffer(target.get(), "count", &count));
  EXPECT_EQ(values<int64_t>(count), (std::vector<int64_t>{1}));
  dp_tensor_destroy(count);
  DP_ASSERT_OK(dp_module_save(target.get(), second.c_str()));
  EXPECT_EQ(read_bytes(first), read_bytes(second));
  std::remove(first.c_str());
  std::remove(second.c_str());
}

// An empty tensor (no memory behind it) is saved with no bytes and loads back.
TEST(StateDict, EmptyTensorsSaveAndLoadBetweenOthers) {
  auto build = [](float start) {
    ModulePtr root = new_module();
    auto first = make<float>({2}, {start, start + 1});
    auto empty = make<float>({0, 3}, {});
    auto last = make<float>({1}, {start + 2});
    DP_EXPECT_OK(dp_module_register_parameter(root.get(), "first", first.get(), 1));
    DP_EXPECT_OK(dp_module_register_parameter(root.get(), "empty", empty.get(), 1));
    DP_EXPECT_OK(dp_module_register_parameter(root.get(), "last", last.get(), 1));
    return root;
  };
  ModulePtr source = build(1.0f), target = build(7.0f);
  std::string path = temp_path("empty.safetensors");
  DP_ASSERT_OK(dp_module_save(source.get(), path.c_str()));
  EXPECT_TRUE(contains(read_bytes(path), "\"empty\":{\"dtype\":\"F32\",\"shape\":[0,3],\"data_offsets\":[8,8]}"));
  DP_ASSERT_OK(dp_module_load(target.get(), path.c_str(), 1));
  EXPECT_EQ(values<float>(parameter(target.get(), "first").get()), (std::vector<float>{1, 2}));
  EXPECT_EQ(values<float>(parameter(target.get(), "last").get()), (std::vector<float>{3}));
  EXPECT_EQ(dptest::shape(parameter(target.get(), "empty").get()), (std::vector<int64_t>{0, 3}));
  std::remove(path.c_str());
}

TEST(StateDict, SharedTensorsAreSavedOnceAndLoadThroughAnyPath) {
  ModulePtr root = new_module();
  auto shared = linear(2, 2);
  DP_ASSERT_OK(dp_module_register_module(root.get(), "a", shared.get()));
  DP_ASSERT_OK(dp_module_register_module(root.get(), "b", shared.get()));
  std::string path = temp_path("shared.safetensors");
  DP_ASSERT_OK(dp_module_save(root.get(), path.c_str()));
  std::string bytes = read_bytes(path);
  EXPECT_TRUE(contains(bytes, "\"a.weight\""));
  EXPECT_FALSE(contains(bytes, "\"b.weight\""));
  // A file that names the tensors by their other path loads strictly too.
  std::string data(24, '\0');
  float w[4] = {5, 6, 7, 8}, b[2] = {9, 10};
  std::memcpy(&data[0], w, 16);
  std::memcpy(&data[16], b, 8);
  write_bytes(path, image("{\"b.weight\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
                          "\"b.bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]}}",
                          data));
  DP_ASSERT_OK(dp_module_load(root.get(), path.c_str(), 1));
  EXPECT_EQ(values<float>(parameter(root.get(), "a.weight").get()), (std::vector<float>{5, 6, 7, 8}));
  std::remove(path.c_str());
}

TEST(StateDict, StrictLoadNamesEveryMissingAndUnexpectedKey) {
  ModulePtr m = model(1.0f);
  std::string path = temp_path("keys.safetensors");
  write_bytes(path, image("{\"fc.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
                          "\"extra\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[24,26]},"
                          "\"scratch\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[26,42]}}",
                          std::string(42, '\x01')));
  EXPECT_EQ(dp_module_load(m.get(), path.c_str(), 1), DP_EINVAL);
  std::string error = last_error();
  EXPECT_TRUE(contains(error, "missing keys: \"count\", \"fc.bias\"")) << error;
  EXPECT_TRUE(contains(error, "unexpected keys: \"extra\", \"scratch\"")) << error;
  EXPECT_EQ(values<float>(parameter(m.get(), "fc.weight").get()), iota<float>(6, 1.0f));  // unchanged
  // Not strict: the matching key loads, the rest is ignored.
  DP_ASSERT_OK(dp_module_load(m.get(), path.c_str(), 0));
  EXPECT_NE(values<float>(parameter(m.get(), "fc.weight").get()), iota<float>(6, 1.0f));
  EXPECT_EQ(values<float>(parameter(m.get(), "fc.bias").get()), (std::vector<float>{101, 102}));
  std::remove(path.c_str());
}

TEST(StateDict, ShapeOrDtypeMismatchNamesTheKeyAndBothShapes) {
  ModulePtr m = model(1.0f);
  std::string path = temp_path("mismatch.safetensors");
  write_bytes(path, image("{\"fc.weight\":{\"dtype\":\"F32\",\"shape\":[3,2],\"data_offsets\":[0,24]},"
                          "\"fc.bias\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[24,40]},"
                          "\"count\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[40,48]}}",
                          std::string(48, '\0')));
  for (int strict : {1, 0}) {
    EXPECT_EQ(dp_module_load(m.get(), path.c_str(), strict), DP_EINVAL);
    std::string error = last_error();
    EXPECT_TRUE(
        contains(error, "size mismatch for \"fc.weight\": the file has float32 3x2, the module has float32 2x3"))
        << error;
    EXPECT_TRUE(contains(error, "size mismatch for \"fc.bias\": the file has float64 2, the module has float32 2"))
        << error;
  }
  dp_tensor* count = nullptr;
  DP_ASSERT_OK(dp_module_get_buffer(m.get(), "count", &count));
  EXPECT_EQ(values<int64_t>(count), (std::vector<int64_t>{1}));  // nothing was copied
  dp_tensor_destroy(count);
  std::remove(path.c_str());
}

TEST(StateDict, IoFailuresAreReported) {
  ModulePtr m = model(1.0f);
  EXPECT_EQ(dp_module_load(m.get(), "/nonexistent/dir/x.safetensors", 1), DP_EIO);
  EXPECT_TRUE(contains(last_error(), "cannot open '/nonexistent/dir/x.safetensors'")) << last_error();
  EXPECT_EQ(dp_module_save(m.get(), "/nonexistent/dir/x.safetensors"), DP_EIO);
  EXPECT_TRUE(contains(last_error(), "cannot create")) << last_error();
  // Not a regular file: a bad argument, refused before any read or write.
  EXPECT_EQ(dp_module_load(m.get(), ::testing::TempDir().c_str(), 1), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "is a directory; checkpoints are regular files")) << last_error();
  EXPECT_EQ(dp_module_save(m.get(), ::testing::TempDir().c_str()), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "is a directory; checkpoints are regular files")) << last_error();
  EXPECT_EQ(dp_module_save(m.get(), nullptr), DP_EINVAL);
  EXPECT_EQ(dp_module_load(nullptr, "x", 1), DP_EINVAL);
}

// A saved file whose data changed (a flipped bit, another file's bytes
// spliced in) is refused as damaged, naming it, before anything loads; a
// checksum that is not eight hex digits is refused too. A file without a
// checksum (another writer's) still loads.
TEST(StateDict, AFileWhoseDataDiffersFromItsChecksumIsRefusedAndChangesNothing) {
  ModulePtr saved = model(7.0f);
  std::string path = temp_path("damaged.safetensors");
  DP_ASSERT_OK(dp_module_save(saved.get(), path.c_str()));
  const std::string good = read_bytes(path);
  ModulePtr m = model(1.0f);
  std::string flipped = good;
  flipped[flipped.size() - 3] = static_cast<char>(flipped[flipped.size() - 3] ^ 0x10);
  write_bytes(path, flipped);
  EXPECT_EQ(dp_module_load(m.get(), path.c_str(), 1), DP_EIO);
  EXPECT_TRUE(contains(last_error(), "is damaged")) << last_error();
  EXPECT_TRUE(contains(last_error(), path)) << last_error();
  EXPECT_EQ(values<float>(parameter(m.get(), "fc.weight").get()), iota<float>(6, 1.0f));
  std::string bad_text = good;
  const size_t at = bad_text.find("\"dp.crc32c\":\"") + 13;
  bad_text[at] = 'X';
  write_bytes(path, bad_text);
  EXPECT_EQ(dp_module_load(m.get(), path.c_str(), 1), DP_EIO);
  EXPECT_TRUE(contains(last_error(), "is not eight lowercase hex digits")) << last_error();
  EXPECT_EQ(values<float>(parameter(m.get(), "fc.weight").get()), iota<float>(6, 1.0f));
  write_bytes(path, good);
  DP_ASSERT_OK(dp_module_load(m.get(), path.c_str(), 1));
  EXPECT_EQ(values<float>(parameter(m.get(), "fc.weight").get()), iota<float>(6, 7.0f));
  std::remove(path.c_str());
}

// Every file under tests/module/malformed/ is refused with a message, and the
// module keeps its values.
TEST(StateDict, MalformedFilesAreRefusedWithoutChangingTheModule) {
  ModulePtr m = model(1.0f);
  const std::string weight = "\"fc.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":";
  const std::string rest =
      "\"fc.bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[24,32]},"
      "\"count\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[32,40]}";
  const std::string good = "{" + weight + "[0,24]}," + rest + "}";
  std::string valid = image(good, std::string(40, '\x02'));
  std::string huge_length = valid;
  huge_length[7] = '\x7f';
  std::string slightly_long = valid;
  slightly_long[0] = static_cast<char>(slightly_long[0] + 1);
  struct Case {
    const char* what;
    std::string bytes;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"empty", "", "shorter than the 8-byte header length"},
      {"short length", std::string(5, '\0'), "shorter than the 8-byte header length"},
      {"absurd header length", huge_length, "more than the 100000000 allowed"},
      {"header past the end", slightly_long.substr(0, 8 + good.size()), "bytes follow it"},
      {"truncated data", valid.substr(0, valid.size() - 1), "outside the 39-byte data section"},
      {"trailing data", valid + "x", "the data section holds 41 bytes"},
      {"not json", image("{not json}", ""), "not a JSON object"},
      {"not an object", image("[1,2]", ""), "does not start with '{'"},
      {"too deep", image("{\"a\":{\"b\":[[[1]]]}}", ""), "nests deeper"},
      {"wrong dtype", image("{\"a\":{\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]}}", "abcd"),
       "dtype \"F33\""},
      {"negative offset", image("{" + weight + "[-1,24]}," + rest + "}", std::string(40, '\0')),
       "non-negative integers"},
      {"float shape", image("{\"x\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,1]}}", "a"),
       "non-negative integers"},
      {"offsets reversed", image("{" + weight + "[24,0]}," + rest + "}", std::string(40, '\0')), "outside"},
      {"size does not match shape", image("{" + weight + "[0,20]}," + rest + "}", std::string(40, '\0')),
       "need 24 bytes"},
      {"overlap",
       image("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
             "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[1,3]}}",
             "abc"),
       "must not overlap or leave gaps"},
      {"gap",
       image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
             "\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]}}",
             "abc"),
       "must not overlap or leave gaps"},
      {"out of range", image("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[18446744073709551612,0]}}", ""),
       "outside"},
      {"numel overflow",
       image("{\"a\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}", ""),
       "more elements than fit in 64 bits"},
      {"too many dims",
       image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"
             "\"data_offsets\":[0,1]}}",
             "a"),
       "17 dimensions"},
      {"missing field", image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", "a"), "no \"data_offsets\" pair"},
      {"bad metadata", image("{\"__metadata__\":{\"format\":1}}", ""), "is not a string"},
      {"entry not an object", image("{\"a\":3}", ""), "is not an object"},
      {"invalid utf-8", image("{\"\xff\":{}}", ""), "not a JSON object"},
  };
  std::string path = temp_path("malformed.safetensors");
  for (const Case& c : cases) {
    write_bytes(path, c.bytes);
    EXPECT_EQ(dp_module_load(m.get(), path.c_str(), 0), DP_EIO) << c.what;
    EXPECT_TRUE(contains(last_error(), c.message)) << c.what << ": " << last_error();
    EXPECT_TRUE(contains(last_error(), path)) << c.what;
  }
  EXPECT_EQ(values<float>(parameter(m.get(), "fc.weight").get()), iota<float>(6, 1.0f));
  // The valid image itself loads.
  write_bytes(path, valid);
  DP_EXPECT_OK(dp_module_load(m.get(), path.c_str(), 1));
  std::remove(path.c_str());
}

// The fuzzer's seed corpus, loaded into a module: each file loads or is
// refused with a status, and a refused one leaves the module unchanged.
TEST(StateDict, FuzzCorpusLoadsOrIsRefusedCleanly) {
  DIR* dir = opendir(DP_FUZZ_CORPUS_DIR);
  ASSERT_NE(dir, nullptr) << DP_FUZZ_CORPUS_DIR;
  size_t files = 0, loaded = 0;
  while (dirent* e = readdir(dir)) {
    std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    ++files;
    ModulePtr m = model(1.0f);
    std::string path = std::string(DP_FUZZ_CORPUS_DIR) + "/" + name;
    dp_status status = dp_module_load(m.get(), path.c_str(), 0);
    EXPECT_TRUE(status == DP_OK || status == DP_EIO || status == DP_EINVAL) << name << ": " << status;
    if (status != DP_OK) {
      EXPECT_NE(last_error(), "") << name;
      EXPECT_EQ(values<float>(parameter(m.get(), "fc.weight").get()), iota<float>(6, 1.0f)) << name;
    } else {
      ++loaded;
    }
  }
  closedir(dir);
  EXPECT_GE(files, 8u);
  EXPECT_GE(loaded, 1u);  // the valid seeds load (their keys are simply unexpected here)
}
