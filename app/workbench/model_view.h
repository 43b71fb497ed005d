#pragma once
// The Model page: what a checkpoint is (configuration form, parameter counts, fingerprint), its
// layers x query-heads grid coloured by KV group, and the list of stored tensors. It only displays a
// ModelSummary; reading the checkpoint is summarize_checkpoint()'s job.
#include <QHash>
#include <QList>
#include <QWidget>
#include <optional>

#include "model_summary.h"

class QFormLayout;
class QLabel;
class QLineEdit;
class QSortFilterProxyModel;
class QStackedWidget;
class QTabWidget;
class QTableView;

namespace hh::workbench {

class HeadGridModel;
class TensorTableModel;

class ModelView : public QWidget {
  Q_OBJECT

 public:
  explicit ModelView(QWidget* parent = nullptr);

  void setSummary(const ModelSummary& summary);
  void clear();
  bool hasModel() const { return summary_.has_value(); }

  // The value of the configuration form's row `key` (the config.json field name, or one of
  // "kv_group_size", "dtype", "parameters", "parameters_counted", "fingerprint", "files"); the whole
  // value even where the row shows a shortened one (the fingerprint).
  QString fieldText(const QString& key) const;
  QStringList fieldKeys() const { return fields_.keys(); }
  // Whether the form flags that the config's parameter count differs from the tensors' total.
  bool parameterWarningShown() const;

  HeadGridModel* headGridModel() const { return head_grid_; }
  TensorTableModel* tensorModel() const { return tensors_; }
  QTableView* headGridView() const { return head_view_; }
  QTabWidget* tabs() const { return tabs_; }

 Q_SIGNALS:
  void openRequested();  // the empty page's "Open Checkpoint…" button

 private:
  QWidget* buildEmptyPage();
  QWidget* buildContentPage();
  QWidget* buildOverviewTab();
  QWidget* buildTensorsTab();
  QWidget* buildConfigForm();
  QWidget* buildHeadGridPanel();
  QLabel* addField(QFormLayout* form, const QString& key, const QString& label, const QString& tooltip = {});
  void setField(const QString& key, const QString& text, const QString& tooltip = {});
  void updateTensorCount();
  void fitHeadGrid();

  std::optional<ModelSummary> summary_;
  QStackedWidget* pages_ = nullptr;
  QTabWidget* tabs_ = nullptr;
  QLabel* title_ = nullptr;
  QLabel* subtitle_ = nullptr;
  QHash<QString, QLabel*> fields_;   // value label per form row; property "fullText" holds the value
  QList<QLabel*> form_labels_;        // the row names, aligned to one width
  QLabel* param_warning_icon_ = nullptr;
  QLabel* head_legend_ = nullptr;
  HeadGridModel* head_grid_ = nullptr;
  QTableView* head_view_ = nullptr;
  TensorTableModel* tensors_ = nullptr;
  QSortFilterProxyModel* tensor_proxy_ = nullptr;
  QTableView* tensor_view_ = nullptr;
  QLineEdit* tensor_filter_ = nullptr;
  QLabel* tensor_count_ = nullptr;
};

}  // namespace hh::workbench
