// config_test.cpp: config parsing, validation messages, overrides, resolution.
#include <gtest/gtest.h>

#include "engine/config.h"
#include "engine/error.h"

using mhar::Config;
using nlohmann::json;

namespace {
std::string error_of(const json& j) {
  try {
    mhar::config_from_json(j, "test.json");
  } catch (const mhar::Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Config, DefaultsAreValidAndRoundTrip) {
  Config c = mhar::config_from_json(json::object(), "test.json");
  Config d = mhar::config_from_json(c.to_json(), "again.json");
  EXPECT_EQ(c.to_json(), d.to_json());
}

TEST(Config, UnknownKeyIsRejectedWithItsPath) {
  std::string e = error_of({{"model", {{"n_layer", 4}}}});
  EXPECT_NE(e.find("unknown key model.n_layer"), std::string::npos) << e;
  EXPECT_NE(e.find("n_layers"), std::string::npos) << "lists valid keys: " << e;
  e = error_of({{"modle", json::object()}});
  EXPECT_NE(e.find("unknown section modle"), std::string::npos) << e;
}

TEST(Config, MessagesNameFieldValueAndRule) {
  std::string e = error_of({{"model", {{"n_heads", 12}, {"n_kv_heads", 5}}}});
  EXPECT_NE(e.find("test.json: model.n_kv_heads = 5 does not divide model.n_heads = 12"),
            std::string::npos) << e;
  e = error_of({{"model", {{"d_model", 1000}}}, {"residual", {{"mode", "mhar"}, {"heads", 12}}}});
  EXPECT_NE(e.find("residual.heads = 12 does not divide model.d_model = 1000"), std::string::npos)
      << e;
  e = error_of({{"residual", {{"mode", "mhra"}}}});
  EXPECT_NE(e.find("residual.mode = \"mhra\" is not a residual mode"), std::string::npos) << e;
  e = error_of({{"model", {{"d_model", "512"}}}});
  EXPECT_NE(e.find("model.d_model = \"512\" has type string; expected an integer"),
            std::string::npos) << e;
  e = error_of({{"train", {{"seq_len", 4096}}}, {"model", {{"context_length", 2048}}}});
  EXPECT_NE(e.find("train.seq_len = 4096 exceeds model.context_length = 2048"), std::string::npos)
      << e;
}

TEST(Config, RoutingHeadsDefaultToKvHeads) {
  Config c = mhar::config_from_json({{"residual", {{"mode", "mhar"}}}, {"model", {{"n_kv_heads", 4}}}});
  EXPECT_EQ(c.residual.heads, 4);
  c = mhar::config_from_json({{"residual", {{"mode", "attnres"}}}});
  EXPECT_EQ(c.residual.heads, 1);
  EXPECT_NE(error_of({{"residual", {{"mode", "attnres"}, {"heads", 2}}}}), "");
}

TEST(Config, OverridesParseJsonOrStrings) {
  json j = {{"model", {{"n_layers", 12}}}};
  mhar::apply_override(j, "model.n_layers=4", "t");
  mhar::apply_override(j, "residual.mode=mhar", "t");
  mhar::apply_override(j, "train.lr=3e-4", "t");
  Config c = mhar::config_from_json(j);
  EXPECT_EQ(c.model.n_layers, 4);
  EXPECT_EQ(c.residual.mode, mhar::ResidualMode::Mhar);
  EXPECT_DOUBLE_EQ(c.train.lr, 3e-4);
  EXPECT_THROW(mhar::apply_override(j, "nolayers", "t"), mhar::Error);
  mhar::apply_override(j, "model.n_layerz=4", "t");
  EXPECT_THROW(mhar::config_from_json(j), mhar::Error);
}
