// Discovery, trust and loading of plugins, end to end through the `cai` binary: every bad
// input is reported with the file and the reason, exits non-zero, and leaves the other
// plugins usable.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "cai/core.h"
#include "core/json.h"
#include "loader/file_checks.h"
#include "plugin_dir.h"
#include "util/subprocess.h"

namespace {

namespace fs = std::filesystem;

using cai::testing::Lib;
using cai::testing::ManifestText;
using cai::testing::PluginDir;
using cai::testing::Result;

// Runs `cai ARGS` with only the given plugin search variables set.
Result Cai(const std::string& args, const std::string& env = "") {
  return cai::testing::RunCommand("env -u CAI_PLUGIN_PATH -u CAI_PLUGIN_FILES HOME=/nonexistent " +
                                  env + " " + CAI_EXE + " " + args);
}

void ExpectContains(const std::string& haystack, const std::string& needle) {
  CAI_EXPECT_CONTAINS(haystack, needle);
}

// A directory with one good plugin (hello_strategy) and one broken one, searched alone; the
// listing must fail, name the broken manifest and reason, and still show hello_strategy ok.
void ExpectBrokenBesideGood(PluginDir& dir, const fs::path& broken, const std::string& reason) {
  Result r = Cai("plugins list", "CAI_PLUGIN_FILES=" + dir.str());
  EXPECT_NE(r.code, 0) << r.output;
  ExpectContains(r.output, broken.string());
  ExpectContains(r.output, reason);
  ExpectContains(r.output, "hello_strategy      0.1.0     1.0+    ok");
}

TEST(PluginLoading, GoodPlugins_AreListedOkAndExitZero) {
  PluginDir dir;
  dir.AddHello();
  dir.Add(C_REPLICA_SO, "c_replica", ManifestText("c_replica", Lib(C_REPLICA_SO)));
  Result r = Cai("plugins list", "CAI_PLUGIN_FILES=" + dir.str());
  EXPECT_EQ(r.code, 0) << r.output;
  ExpectContains(r.output, "hello_strategy      0.1.0     1.0+    ok");
  ExpectContains(r.output, "c_replica           1.0.0     1.0+    ok");
  Result json = Cai("plugins list --json", "CAI_PLUGIN_FILES=" + dir.str());
  EXPECT_EQ(json.code, 0);
  ExpectContains(json.output, "\"name\": \"c_replica\"");
  ExpectContains(json.output, "\"found_in\": \"CAI_PLUGIN_FILES\"");
}

TEST(PluginLoading, MissingManifest_NamesFile) {
  Result r = Cai("plugins list", "CAI_PLUGIN_FILES=/nonexistent/x.toml");
  EXPECT_NE(r.code, 0);
  ExpectContains(r.output, "/nonexistent/x.toml: manifest not found");
}

TEST(PluginLoading, MalformedManifest_NamesFileAndLine) {
  PluginDir dir;
  dir.AddHello();
  auto bad = dir.Add("", "bad", "manifest_version = 1\n[plugin\nname = 1\n");
  ExpectBrokenBesideGood(dir, bad, "malformed TOML at line 2");
}

TEST(PluginLoading, MissingKey_NamesKey) {
  PluginDir dir;
  dir.AddHello();
  std::string text = ManifestText("c_replica", Lib(C_REPLICA_SO));
  text.erase(text.find("license = \"Apache-2.0\"\n"), 23);
  auto bad = dir.Add(C_REPLICA_SO, "c_replica", text);
  ExpectBrokenBesideGood(dir, bad, "missing required key 'plugin.license'");
}

TEST(PluginLoading, WrongType_NamesKeyAndType) {
  PluginDir dir;
  dir.AddHello();
  auto bad = dir.Add(
      C_REPLICA_SO, "c_replica",
      ManifestText("c_replica", Lib(C_REPLICA_SO), "", "major = \"1\"\nmin_host_minor = 0"));
  ExpectBrokenBesideGood(dir, bad, "key 'abi.major' (line 12) must be an integer");
}

TEST(PluginLoading, UnknownKey_NamesNearestValidKey) {
  PluginDir dir;
  dir.AddHello();
  auto bad = dir.Add(C_REPLICA_SO, "c_replica",
                     ManifestText("c_replica", Lib(C_REPLICA_SO), "licence = \"MIT\"\n"));
  ExpectBrokenBesideGood(dir, bad,
                         "unknown key 'plugin.licence' (line 8). did you mean 'license'?");
}

TEST(PluginLoading, LibraryPathEscapingTheDirectory_IsRefused) {
  for (const std::string& path :
       {std::string("../") + Lib(C_REPLICA_SO), std::string("/usr/lib/") + Lib(C_REPLICA_SO)}) {
    PluginDir dir;
    dir.AddHello();
    auto bad = dir.Add(C_REPLICA_SO, "c_replica", ManifestText("c_replica", path));
    ExpectBrokenBesideGood(dir, bad,
                           "library.path '" + path +
                               "' must be a file name in the "
                               "manifest's directory");
  }
}

TEST(PluginLoading, MissingLibrary_NamesLibraryAndManifest) {
  PluginDir dir;
  dir.AddHello();
  auto bad = dir.Add("", "ghost", ManifestText("ghost", "libghost.so"));
  ExpectBrokenBesideGood(dir, bad,
                         (dir.path() / "libghost.so").string() + ": plugin library not found");
}

TEST(PluginLoading, LibraryWithoutEntrySymbol_FailsToLoadOthersStillLoad) {
  PluginDir dir;
  dir.AddHello();
  dir.Add(NO_ENTRY_SO, "no_entry", ManifestText("no_entry", Lib(NO_ENTRY_SO)));
  Result info = Cai("plugins info no_entry", "CAI_PLUGIN_FILES=" + dir.str());
  EXPECT_NE(info.code, 0);
  ExpectContains(info.output, (dir.path() / Lib(NO_ENTRY_SO)).string());
  ExpectContains(info.output, "does not export the entry symbol 'cai_plugin_init_v1'");
  Result check = Cai("plugins check " + (dir.path() / "no_entry.toml").string());
  EXPECT_NE(check.code, 0);
  ExpectContains(check.output, "[ FAIL ] exports only the entry symbol: does not export");
  EXPECT_EQ(Cai("plugins info hello_strategy", "CAI_PLUGIN_FILES=" + dir.str()).code, 0);
}

TEST(PluginLoading, EntryThatThrows_IsCaughtAndReported) {
  PluginDir dir;
  dir.AddHello();
  dir.Add(THROWING_SO, "throwing", ManifestText("throwing", Lib(THROWING_SO)));
  Result info = Cai("plugins info throwing", "CAI_PLUGIN_FILES=" + dir.str());
  EXPECT_NE(info.code, 0);
  ExpectContains(info.output, (dir.path() / Lib(THROWING_SO)).string() +
                                  ": cai_plugin_init_v1 threw a C++ exception (fixture: "
                                  "initialisation exploded)");
  EXPECT_EQ(Cai("plugins info hello_strategy", "CAI_PLUGIN_FILES=" + dir.str()).code, 0);
}

TEST(PluginLoading, AbiMajorMismatch_IsRefusedBeforeLoading) {
  PluginDir dir;
  dir.AddHello();
  auto bad = dir.Add(THROWING_SO, "future",
                     ManifestText("future", Lib(THROWING_SO), "", "major = 2\nmin_host_minor = 0"));
  // The throwing library is never run: the manifest alone refuses it.
  ExpectBrokenBesideGood(
      dir, bad,
      "plugin is built for cai ABI 2.x; this host speaks ABI 1." + std::to_string(CAI_ABI_MINOR));
}

TEST(PluginLoading, PluginNeedingNewerHostMinor_IsRefused) {
  PluginDir dir;
  dir.AddHello();
  auto by_manifest =
      dir.Add(C_REPLICA_SO, "c_replica",
              ManifestText("c_replica", Lib(C_REPLICA_SO), "", "major = 1\nmin_host_minor = 7"));
  ExpectBrokenBesideGood(
      dir, by_manifest,
      "plugin needs host ABI 1.7 or newer; this host is 1." + std::to_string(CAI_ABI_MINOR));
  // A manifest that understates what the library needs is caught by the negotiation.
  PluginDir dir2;
  dir2.Add(C_REPLICA_FUTURE_SO, "c_replica", ManifestText("c_replica", Lib(C_REPLICA_FUTURE_SO)));
  Result info = Cai("plugins info c_replica", "CAI_PLUGIN_FILES=" + dir2.str());
  EXPECT_NE(info.code, 0);
  ExpectContains(info.output,
                 "needs host ABI 1.99 or newer; this host is 1." + std::to_string(CAI_ABI_MINOR));
}

TEST(PluginLoading, ManifestMinorOtherThanTheLibraryNeeds_IsRefusedWithTheValueToSet) {
  // c_replica is built from the 1.0 headers and needs host 1.0; its manifest claims 1.1.
  PluginDir dir;
  auto manifest =
      dir.Add(C_REPLICA_SO, "c_replica",
              ManifestText("c_replica", Lib(C_REPLICA_SO), "", "major = 1\nmin_host_minor = 1"));
  const std::string expected = manifest.string() + ": [abi] min_host_minor = 1 but " +
                               (dir.path() / Lib(C_REPLICA_SO)).string() +
                               " was built to need host ABI 1.0 (CAI_TARGET_ABI_MINOR); set "
                               "min_host_minor = 0";
  Result info = Cai("plugins info c_replica", "CAI_PLUGIN_FILES=" + dir.str());
  EXPECT_NE(info.code, 0);
  ExpectContains(info.output, expected);
  Result check = Cai("plugins check " + manifest.string());
  EXPECT_NE(check.code, 0);
  ExpectContains(check.output,
                 "[ FAIL ] loads, negotiates the ABI and returns a valid table: " + expected);
}

TEST(PluginLoading, InTreePlugins_ManifestMinorIsWhatTheLibraryNeeds) {
  // Every manifest built beside bin/cai (the in-tree plugins and the SDK example) loads.
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(BUILD_PLUGIN_DIR)) {
    if (entry.path().extension() != ".toml") continue;
    Result check = Cai("plugins check --structure-only " + entry.path().string());
    EXPECT_EQ(check.code, 0) << check.output;
    ExpectContains(check.output, "[ PASS ] loads, negotiates the ABI and returns a valid table");
    ++checked;
  }
  EXPECT_GE(checked, 4);  // ddp, fsdp, low_level_zero, hello_strategy
}

TEST(PluginLoading, Sha256Mismatch_IsRefusedAndMatchAccepted) {
  PluginDir dir;
  dir.AddHello();
  std::string wrong(64, 'a');
  auto bad = dir.Add(C_REPLICA_SO, "c_replica",
                     ManifestText("c_replica", Lib(C_REPLICA_SO), "",
                                  "major = 1\nmin_host_minor = 0", "sha256 = \"" + wrong + "\"\n"));
  ExpectBrokenBesideGood(dir, bad, "sha256 mismatch: manifest " + bad.string() + " says " + wrong);
  dir.Add(C_REPLICA_SO, "c_replica",
          ManifestText("c_replica", Lib(C_REPLICA_SO), "", "major = 1\nmin_host_minor = 0",
                       "sha256 = \"" + cai::Sha256File(C_REPLICA_SO) + "\"\n"));
  EXPECT_EQ(Cai("plugins list", "CAI_PLUGIN_FILES=" + dir.str()).code, 0);
}

TEST(PluginLoading, DirectoryWritableByOthers_IsRefusedOtherDirsStillLoad) {
  PluginDir open_dir, good_dir;
  good_dir.AddHello();
  auto bad = open_dir.Add(C_REPLICA_SO, "c_replica", ManifestText("c_replica", Lib(C_REPLICA_SO)));
  chmod(open_dir.path().c_str(), 0777);
  Result r = Cai("plugins list", "CAI_PLUGIN_FILES=" + open_dir.str() + ":" + good_dir.str());
  EXPECT_NE(r.code, 0);
  ExpectContains(r.output, bad.string());
  ExpectContains(r.output, open_dir.str() +
                               ": refused: directory is writable by group or others "
                               "(mode 0777)");
  ExpectContains(r.output, "hello_strategy      0.1.0     1.0+    ok");
}

TEST(PluginLoading, LibraryWritableByGroup_IsRefused) {
  PluginDir dir;
  dir.AddHello();
  auto bad = dir.Add(C_REPLICA_SO, "c_replica", ManifestText("c_replica", Lib(C_REPLICA_SO)));
  chmod((dir.path() / Lib(C_REPLICA_SO)).c_str(), 0775);
  ExpectBrokenBesideGood(
      dir, bad,
      (dir.path() / Lib(C_REPLICA_SO)).string() + ": refused: file is writable by group or others");
}

TEST(PluginLoading, LibraryOwnedByAnotherUser_IsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to chown a file to another user";
  PluginDir dir;
  dir.AddHello();
  auto bad = dir.Add(C_REPLICA_SO, "c_replica", ManifestText("c_replica", Lib(C_REPLICA_SO)));
  ASSERT_EQ(chown((dir.path() / Lib(C_REPLICA_SO)).c_str(), 65534, 65534), 0);
  ExpectBrokenBesideGood(dir, bad,
                         "owned by uid 65534, which is neither root nor the current user");
}

TEST(PluginLoading, SameNameTwice_FirstWinsSecondIsShadowedNotBroken) {
  PluginDir first, second;
  first.Add(C_REPLICA_SO, "c_replica", ManifestText("c_replica", Lib(C_REPLICA_SO)));
  auto shadowed =
      second.Add(C_REPLICA_SO, "c_replica", ManifestText("c_replica", Lib(C_REPLICA_SO)));
  const std::string winner = (first.path() / "c_replica.toml").string();
  Result r =
      Cai("--plugin-path " + first.str() + " plugins list", "CAI_PLUGIN_PATH=" + second.str());
  EXPECT_EQ(r.code, 0) << r.output;
  ExpectContains(r.output, "c_replica           1.0.0     1.0+    ok        " + winner);
  ExpectContains(r.output, "c_replica           1.0.0     1.0+    shadowed  " + shadowed.string() +
                               "\n    shadowed by " + winner +
                               " (found first, so it is the one used)\n");
  EXPECT_EQ(r.output.find("error"), std::string::npos) << r.output;
  Result json = Cai("--plugin-path " + first.str() + " plugins list --json",
                    "CAI_PLUGIN_PATH=" + second.str());
  EXPECT_EQ(json.code, 0) << json.output;
  ExpectContains(json.output, "\"path\": " + cai::JsonQuote(winner) +
                                  ", \"found_in\": \"--plugin-path\", \"status\": \"ok\", "
                                  "\"error\": \"\", \"shadowed_by\": null}");
  ExpectContains(json.output, "\"path\": " + cai::JsonQuote(shadowed.string()) +
                                  ", \"found_in\": \"CAI_PLUGIN_PATH\", \"status\": "
                                  "\"shadowed\", \"error\": \"\", \"shadowed_by\": " +
                                  cai::JsonQuote(winner) + "}");
}

TEST(PluginLoading, ShadowedPlugin_IsNeverUsedEvenWhenTheWinnerFailsToLoad) {
  // The first c_replica passes inspection but fails at load (its manifest misstates the
  // minor); the good one it shadows must not be taken instead.
  PluginDir first, second;
  first.Add(C_REPLICA_SO, "c_replica",
            ManifestText("c_replica", Lib(C_REPLICA_SO), "", "major = 1\nmin_host_minor = 1"));
  second.Add(C_REPLICA_SO, "c_replica", ManifestText("c_replica", Lib(C_REPLICA_SO)));
  Result info =
      Cai("plugins info c_replica", "CAI_PLUGIN_FILES=" + first.str() + ":" + second.str());
  EXPECT_NE(info.code, 0) << info.output;
  ExpectContains(info.output,
                 (first.path() / "c_replica.toml").string() + ": [abi] min_host_minor = 1 but");
}

TEST(PluginLoading, ShadowedAndBroken_IsReportedBrokenAndFailsTheListing) {
  PluginDir first, second;
  first.AddHello();
  auto bad =
      second.Add(HELLO_SO, "hello_strategy",
                 ManifestText("hello_strategy", Lib(HELLO_SO), "", "major = 1\nmin_host_minor = 0",
                              "sha256 = \"" + std::string(64, 'a') + "\"\n"));
  Result r = Cai("plugins list", "CAI_PLUGIN_FILES=" + first.str() + ":" + second.str());
  EXPECT_NE(r.code, 0) << r.output;
  ExpectContains(r.output, "broken    " + bad.string() + "\n    error: ");
  ExpectContains(r.output, "sha256 mismatch");
}

TEST(PluginLoading, PluginFilesVariable_ReplacesTheSearchPath) {
  PluginDir listed, ignored;
  auto manifest =
      listed.Add(C_REPLICA_SO, "c_replica", ManifestText("c_replica", Lib(C_REPLICA_SO)));
  ignored.AddHello();
  Result r = Cai("plugins list",
                 "CAI_PLUGIN_FILES=" + manifest.string() + " CAI_PLUGIN_PATH=" + ignored.str());
  EXPECT_EQ(r.code, 0) << r.output;
  ExpectContains(r.output, "c_replica");
  EXPECT_EQ(r.output.find("hello_strategy"), std::string::npos) << r.output;
}

TEST(PluginLoading, PluginFromFrozenV1_0Headers_LoadsAndPassesConformance) {
  PluginDir dir;
  auto manifest = dir.Add(C_REPLICA_SO, "c_replica", ManifestText("c_replica", Lib(C_REPLICA_SO)));
  // Its behaviour (training on 1 and 2 ranks) is checked by Sdk_Conformance_CReplicaFromAbi1_0.
  Result check = Cai("plugins check --structure-only " + manifest.string());
  EXPECT_EQ(check.code, 0) << check.output;
  ExpectContains(check.output, "built for ABI 1.0, needs host 1.0+");
  Result info = Cai("plugins info c_replica", "CAI_PLUGIN_FILES=" + dir.str());
  EXPECT_EQ(info.code, 0) << info.output;
  // Its table ends at 1.0: the 1.1 and 1.3 fields read as absent, not as whatever follows in
  // memory.
  ExpectContains(info.output, "estimate_memory: no");
  ExpectContains(info.output, "parallel_layout: no");
  ExpectContains(info.output, "log_steps (bool, default false)");
}

TEST(PluginLoading, BuildTree_ListsTheExamplePluginBesideTheBinary) {
  // No variables: the plugins beside bin/cai (<build>/<libdir>/cai/plugins) are found, as the
  // packaged ones are beside an installed cai.
  Result r = Cai("plugins list --json");
  CAI_EXPECT_CONTAINS(r.output, "\"name\": \"hello_strategy\"");
  CAI_EXPECT_CONTAINS(r.output, "\"found_in\": \"installed\", \"status\": \"ok\"");
}

TEST(PluginLoading, UnknownPluginName_ListsAvailable) {
  PluginDir dir;
  dir.AddHello();
  Result r = Cai("plugins info hello", "CAI_PLUGIN_FILES=" + dir.str());
  EXPECT_NE(r.code, 0);
  ExpectContains(r.output, "no plugin named 'hello'; available: hello_strategy");
}

}  // namespace
