// The sharded save's manifest: what a save writes parses back, and a
// hostile one is refused naming the problem (kIo), never trusted.
#include "fsdp/save_manifest.h"

#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"

namespace {

using dparallel::Error;
using dparallel::StatusCode;
using namespace dparallel::fsdp;

Manifest two_ranks() {
  Manifest m;
  m.save_id = "0123456789abcdef";
  m.world_size = 2;
  for (int32_t r = 0; r < 2; ++r) m.files.push_back({shard_file_name(r, 2, m.save_id), 100u + r, 7u + r});
  m.tensors.push_back({"w", 4, {{0, 0, 2, 11}, {1, 2, 2, 12}}});
  m.tensors.push_back({"b", -1, {{0, -1, -1, 13}}});
  return m;
}

TEST(SaveManifest, WhatASaveWritesParsesBack) {
  const Manifest m = two_ranks();
  const Manifest back = parse_manifest(encode_manifest(m), "manifest.json");
  EXPECT_EQ(back.save_id, m.save_id);
  ASSERT_EQ(back.files.size(), 2u);
  EXPECT_EQ(back.files[1].name, "shard-00001-of-00002-0123456789abcdef.safetensors");
  EXPECT_EQ(back.files[1].bytes, 101u);
  EXPECT_EQ(back.files[1].header_crc, 8u);
  ASSERT_EQ(back.tensors.size(), 2u);
  EXPECT_EQ(back.tensors[0].rows, 4);
  EXPECT_EQ(back.tensors[0].pieces[1].first_row, 2);
  EXPECT_EQ(back.tensors[0].pieces[1].crc, 12u);
  EXPECT_EQ(back.tensors[1].rows, -1);
  std::string id;
  EXPECT_TRUE(parse_shard_file_name(back.files[1].name, &id));
  EXPECT_EQ(id, m.save_id);
  for (const char* bad :
       {"shard-00001-of-00002.safetensors", "shard-00001-of-00002-0123456789ABCDEF.safetensors",
        "shard-1-of-2-0123456789abcdef.safetensors", "shard-00001-of-00002-0123456789abcdef.safetensorsx",
        "x/shard-00001-of-00002-0123456789abcdef.safetensors"}) {
    EXPECT_FALSE(parse_shard_file_name(bad, &id)) << bad;
  }
  EXPECT_TRUE(is_save_id(new_save_id()));
  EXPECT_NE(new_save_id(), new_save_id());
}

TEST(SaveManifest, AHostileManifestIsRefusedNamingTheProblem) {
  const nlohmann::json good = nlohmann::json::parse(encode_manifest(two_ranks()));
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> edit;
    const char* message;
  };
  const Case cases[] = {
      {"not an object", [](nlohmann::json& j) { j = nlohmann::json::array(); }, "not a JSON object"},
      {"another format", [](nlohmann::json& j) { j["format"] = "pt"; }, "\"format\" is not"},
      {"a later version", [](nlohmann::json& j) { j["version"] = 2; }, "version 2"},
      {"a short id", [](nlohmann::json& j) { j["save_id"] = "0123"; }, "save id \"0123\""},
      {"a huge world", [](nlohmann::json& j) { j["world_size"] = 1u << 30; }, "\"world_size\" is 1073741824"},
      {"a negative world", [](nlohmann::json& j) { j["world_size"] = -1; }, "\"world_size\" is -1"},
      {"a world past int64", [](nlohmann::json& j) { j["world_size"] = ~0ull; }, "\"world_size\" is"},
      {"files missing", [](nlohmann::json& j) { j["files"].erase(1); }, "not a list of world_size (2) files"},
      {"a file elsewhere", [](nlohmann::json& j) { j["files"][0]["name"] = "/etc/passwd"; },
       "is named \"/etc/passwd\""},
      {"a file of another save",
       [](nlohmann::json& j) { j["files"][0]["name"] = "shard-00000-of-00002-ffffffffffffffff.safetensors"; },
       "where this save's is"},
      {"a negative size", [](nlohmann::json& j) { j["files"][0]["bytes"] = -5; }, "\"bytes\" is -5"},
      {"a bad checksum", [](nlohmann::json& j) { j["files"][0]["header_crc32c"] = "xyz"; }, "not eight hex digits"},
      {"a piece of no file", [](nlohmann::json& j) { j["tensors"][0]["pieces"][1]["file"] = 2; }, "\"file\" is 2"},
      {"rows past the tensor", [](nlohmann::json& j) { j["tensors"][0]["pieces"][1]["row_count"] = 3; },
       "\"row_count\" is 3"},
      {"rows in two files", [](nlohmann::json& j) { j["tensors"][0]["pieces"][1]["first_row"] = 1; },
       "rows 1 to 2 are in two files"},
      {"rows in no file", [](nlohmann::json& j) { j["tensors"][0]["pieces"][1]["row_count"] = 1; },
       "rows 3 to 4 are in no file"},
      {"a whole tensor in two pieces",
       [](nlohmann::json& j) { j["tensors"][1]["pieces"].push_back(j["tensors"][1]["pieces"][0]); },
       "is whole but has 2 pieces"},
      {"a tensor twice", [](nlohmann::json& j) { j["tensors"].push_back(j["tensors"][1]); }, "is listed twice"},
      {"a name not a string", [](nlohmann::json& j) { j["tensors"][0]["name"] = 3; }, "\"name\" is not a string"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = good;
    c.edit(j);
    try {
      parse_manifest(j.dump(), "m.json");
      ADD_FAILURE() << c.what << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kIo) << c.what;
      EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << c.what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("'m.json'"), std::string::npos) << c.what << ": " << e.what();
    }
  }
  for (const char* text : {"", "{", "null", "[1]", "{\"format\": 1}"}) {
    EXPECT_THROW(parse_manifest(text, "m.json"), Error) << text;
  }
}

}  // namespace
